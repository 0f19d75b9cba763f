import pytest

from worker.engine.textstream import Piece, TextAssembler


def feed(assembler: TextAssembler, chunks: list[bytes]) -> list[Piece]:
    out: list[Piece] = []
    for i, chunk in enumerate(chunks):
        out += assembler.push(chunk, i, 0.5)
    return out + assembler.finish()


@pytest.mark.parametrize(
    ("chunks", "stop", "texts", "indexes"),
    [
        ([b"Hello", b" world"], [], ["Hello", " world"], [0, 1]),
        # an emoji split over three tokens comes out once, whole, at the index of its last token
        ([b"a", b"\xf0\x9f", b"\x8e", b"\x89", b"b"], [], ["a", "\U0001F389", "b"], [0, 3, 4]),
        ([b"\xe6\x97", b"\xa5", b"\xe6\x9c\xac"], [], ["日", "本"], [1, 2]),
        # a stop string cuts the output before it, even across tokens
        ([b"one", b" two", b" ST", b"OP", b" three"], ["STOP"], ["one", " two", " "], [0, 1, 2]),
        # text that looks like a stop string's start is held, then released when it is not
        ([b"x", b" S", b"T", b"ay"], ["STOP"], ["x", " ", "STay"], [0, 1, 3]),
        # the earliest of several stop strings wins
        ([b"abc", b"def"], ["e", "c"], ["ab"], [0]),
    ],
)
def test_pieces(chunks: list[bytes], stop: list[str], texts: list[str], indexes: list[int]) -> None:
    pieces = feed(TextAssembler(stop), chunks)
    assert [p.text for p in pieces] == texts
    assert [p.index for p in pieces] == indexes


def test_probability_is_product_of_joined_tokens() -> None:
    assembler = TextAssembler()
    assert assembler.push(b"\xf0\x9f", 0, 0.5) == []
    assert assembler.push(b"\x8e", 1, 0.5) == []
    [piece] = assembler.push(b"\x89", 2, 0.5)
    assert piece.probability == pytest.approx(0.125)


def test_character_cut_by_the_end_of_generation_is_not_sent_as_mojibake() -> None:
    assembler = TextAssembler()
    assert assembler.push(b"ok", 0, 1.0)[0].text == "ok"
    assert assembler.push(b"\xf0\x9f", 1, 1.0) == []
    assert assembler.finish() == []


def test_nothing_after_stop() -> None:
    assembler = TextAssembler(["."])
    assert [p.text for p in assembler.push(b"end. more", 0, 1.0)] == ["end"]
    assert assembler.stopped
    assert assembler.push(b"more", 1, 1.0) == [] and assembler.finish() == []


def test_real_tokenizer_pieces_rejoin_to_the_original(model) -> None:  # type: ignore[no-untyped-def]
    text = "Fête 🎉 日本語 ñandú"
    tokens = model.tokenize(text, add_special=False)
    pieces = [model.piece(t) for t in tokens]
    assert any(len(p) and p.decode("utf-8", errors="ignore").encode() != p for p in pieces), \
        "the sample must contain a token that splits a character"
    assert "".join(p.text for p in feed(TextAssembler(), pieces)) == text


def test_a_piece_carries_the_alternatives_of_its_first_token_and_the_next_piece_its_own() -> None:
    assembler = TextAssembler()
    first = (("é", -0.1), ("e", -2.0))
    assert assembler.push("é".encode()[:1], 0, 0.5, first) == []  # half a character: held
    (piece,) = assembler.push("é".encode()[1:], 1, 0.5, (("x", -9.0),))
    assert (piece.text, piece.alternatives) == ("é", first)
    (after,) = assembler.push(b"a", 2, 1.0, (("a", -0.01),))
    assert after.alternatives == (("a", -0.01),)
    (plain,) = assembler.push(b"b", 3, 1.0)
    assert plain.alternatives == ()
