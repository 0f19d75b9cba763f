import pytest

from worker.naming import ModelNames, derive_name


@pytest.mark.parametrize(("general", "stem", "expected"), [
    ("SmolLM2 135M Instruct", "SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct"),
    ("Gemma 3 270m It", "gemma-3-270m-q4_k_m", "gemma-3-270m-it"),
    (None, "TinyLlama-1.1B-Chat.Q4_K_M", "tinyllama-1.1b-chat.q4_k_m"),
    ("  ", "model", "model"),
    ("--Ünïcode & stuff!!", "x", "n-code-stuff"),
    ("***", "x", "model"),
    ("a" * 300, "x", "a" * 128),
])
def test_derived_names_are_lower_case_and_predictable(general: str | None, stem: str, expected: str) -> None:
    assert derive_name(general, stem) == expected


def test_the_file_stem_is_always_an_alias_and_a_configured_name_wins() -> None:
    names = ModelNames.choose(configured="", configured_aliases=("tiny",), general_name="SmolLM2 135M",
                              file_stem="SmolLM2.Q4")
    assert names == ModelNames("smollm2-135m", ("tiny", "SmolLM2.Q4"))
    assert names.serves("smollm2-135m") and names.serves("SmolLM2.Q4") and names.serves("tiny")
    assert not names.serves("smollm2")
    configured = ModelNames.choose(configured="tinyllama-1.1b", configured_aliases=("tinyllama-1.1b",),
                                   general_name="whatever", file_stem="tinyllama-1.1b")
    assert configured == ModelNames("tinyllama-1.1b", ())
