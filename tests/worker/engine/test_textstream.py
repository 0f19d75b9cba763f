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


def feed_ids(assembler: TextAssembler, chunks: list[bytes], *, finish: bool = True) -> list[Piece]:
    out: list[Piece] = []
    for i, chunk in enumerate(chunks):
        out += assembler.push(chunk, i, 0.5, (), 100 + i)  # token i's id is 100 + i
    return out + (assembler.finish() if finish else [])


@pytest.mark.parametrize(
    ("chunks", "stop", "texts", "ids"),
    [
        ([b"Hello", b" world"], [], ["Hello", " world"], [[100], [101]]),
        # an emoji split over three tokens, the first of them after an "a": "a" waits for the whole emoji,
        # since a continuation after token 1 would start inside the character
        ([b"a\xf0\x9f", b"\x8e", b"\x89", b"b"], [], ["a\U0001F389", "b"], [[100, 101, 102], [103]]),
        # a possible stop string's start is held with its whole token ("x S" is one token)
        ([b"x S", b"T", b"ay"], ["STOP"], ["x STay"], [[100, 101, 102]]),
        ([b"x", b" S", b"T", b"ay"], ["STOP"], ["x", " STay"], [[100], [101, 102, 103]]),
        # a stop string ends the stream: the last piece covers the tokens whose text starts in it
        ([b"one", b" two", b" ST", b"OP", b" three"], ["STOP"], ["one", " two", " "], [[100], [101], [102]]),
        # ... and a token whose text is all stop string is in no piece
        ([b"one", b"STOP"], ["STOP"], ["one"], [[100]]),
        # a character the generation never finished: its token was never text
        ([b"ok", b"\xf0\x9f"], [], ["ok"], [[100]]),
    ],
)
def test_pieces_with_ids_cover_whole_tokens(chunks: list[bytes], stop: list[str], texts: list[str],
                                            ids: list[list[int]]) -> None:
    pieces = feed_ids(TextAssembler(stop, ids=True), chunks)
    assert [p.text for p in pieces] == texts
    assert [p.ids for p in pieces] == ids
    assert [p.index for p in pieces] == [i[-1] - 100 for i in ids]  # the index of the piece's last token


def test_without_ids_pieces_carry_none_and_are_as_before() -> None:
    chunks = [b"a\xf0\x9f", b"\x8e", b"\x89", b"b", b" S", b"T", b"OP"]
    plain = feed(TextAssembler(["STOP"]), chunks)
    assert all(p.ids is None for p in plain)
    assert "".join(p.text for p in plain) == "".join(p.text for p in feed_ids(TextAssembler(["STOP"], ids=True),
                                                                              chunks))


def test_a_piece_with_ids_has_its_own_tokens_probability_and_alternatives() -> None:
    assembler = TextAssembler(["STOP"], ids=True)
    assert assembler.push(b"x S", 0, 0.5, (("x", -0.1),), 7) == []
    [piece] = assembler.push(b"ay", 1, 0.25, (("ay", -0.2),), 8)
    assert (piece.text, piece.ids, piece.index) == ("x Say", [7, 8], 1)
    assert piece.probability == pytest.approx(0.125) and piece.alternatives == (("x", -0.1),)


CHUNKS = [b"a", b"\xf0\x9f", b"\x8e", b"\x89", b" S", b"T", b"x", b"\xe6\x97", b"\xa5", b" ST", b"O", b"P!",
          b"yes", b"\xc3", b"\xa9", b" STOP", b"z"]


@pytest.mark.parametrize("seed", range(40))
def test_a_continuation_after_any_piece_gives_the_client_exactly_the_same_text(seed: int) -> None:
    """The invariant a continuation rests on: after any piece, the text released so far is exactly the text
    of the ids released so far, and a fresh assembler fed the remaining tokens releases exactly the rest."""
    import random

    rng = random.Random(seed)
    chunks = [rng.choice(CHUNKS) for _ in range(rng.randrange(1, 14))]
    stop = rng.choice([[], ["STOP"], ["ST", "é"], ["x\u65e5"]])
    whole = feed_ids(TextAssembler(stop, ids=True), chunks)
    text = "".join(p.text for p in whole)
    assert text == "".join(p.text for p in feed(TextAssembler(stop), chunks))  # the same text as without ids
    first = TextAssembler(stop, ids=True)
    released: list[Piece] = []
    for i, chunk in enumerate(chunks):
        released += first.push(chunk, i, 1.0, (), i)
        if first.stopped:
            break
        sent = [t for p in released for t in (p.ids or [])]
        assert sent == list(range(len(sent)))  # in order, none twice, none skipped
        so_far = "".join(p.text for p in released)
        assert so_far == b"".join(chunks[t] for t in sent).decode(errors="replace")  # exactly the ids' text
        rest = TextAssembler(stop, ids=True)
        after: list[Piece] = []
        for j in range(len(sent), len(chunks)):
            after += rest.push(chunks[j], j, 1.0, (), j)
            if rest.stopped:
                break
        after += rest.finish()
        assert so_far + "".join(p.text for p in after) == text, (chunks, stop, i)
