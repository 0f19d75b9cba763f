"""Do the pool's embeddings tell a paraphrase from an unrelated sentence? Ten fixed triples.

For each triple (a sentence, a paraphrase of it, an unrelated sentence) the sentence's cosine with its
paraphrase should be higher than with the unrelated one. Prints how many of the ten are, the mean
cosines and the mean margin (paraphrase cosine minus unrelated cosine), and the smallest margin.
All 30 texts go in one `/v1/embeddings` request (vectors are unit length, so a dot product is the
cosine). Against a pool already running (`--url`), or a coordinator and one worker of its own on
loopback (`--model-path`, the default model by default).

    .venv/bin/python -m bench.embedding_pairs [--url http://127.0.0.1:1337] [--model NAME] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH

TRIPLES: tuple[tuple[str, str, str], ...] = (
    ("The cat is sleeping on the sofa.", "A cat naps on the couch.", "The stock market closed higher today."),
    ("How do I reset my password?", "What are the steps to change my login password?",
     "The recipe needs two cups of flour."),
    ("The train to London leaves at nine.", "At nine o'clock the London train departs.",
     "Photosynthesis turns sunlight into chemical energy."),
    ("She bought a new car last week.", "Last week she purchased a new automobile.",
     "The river flooded the valley in spring."),
    ("It is raining heavily outside.", "There is a heavy downpour outdoors.", "He scored three goals in the final."),
    ("The doctor prescribed antibiotics for the infection.",
     "The physician gave him antibiotics to treat the infection.", "Our team deployed the new website on Friday."),
    ("I am very hungry and want to eat.", "I'm starving and would like some food.",
     "The museum opens at ten in the morning."),
    ("The meeting has been postponed until Monday.", "The meeting was moved to Monday.",
     "Penguins live mostly in the Southern Hemisphere."),
    ("This laptop's battery lasts all day.", "The notebook computer runs a full day on one charge.",
     "The orchestra played a symphony by Beethoven."),
    ("Children were playing in the park.", "Kids played in the park.",
     "The bank raised interest rates by half a percent."),
)


@dataclass(frozen=True)
class Result:
    closer: int  # triples whose paraphrase is nearer than the unrelated sentence
    triples: int
    paraphrase: float  # mean cosine, sentence with its paraphrase
    unrelated: float  # mean cosine, sentence with the unrelated one
    margin: float  # mean of (paraphrase - unrelated)
    smallest: float  # the smallest margin

    def line(self) -> str:
        return (f"paraphrase nearer in {self.closer} of {self.triples}; mean cosine paraphrase "
                f"{self.paraphrase:.3f}, unrelated {self.unrelated:.3f}; mean margin {self.margin:+.3f} "
                f"(smallest {self.smallest:+.3f})")


def score(vectors: Sequence[Sequence[float]]) -> Result:
    """`vectors`: the unit vectors of the triples' texts, three per triple, in order."""
    found = np.asarray(vectors, dtype=np.float64)
    if found.shape[0] % 3:
        raise ValueError("three vectors per triple")
    near, far = [], []
    for i in range(0, found.shape[0], 3):
        near.append(float(found[i] @ found[i + 1]))
        far.append(float(found[i] @ found[i + 2]))
    margins = [n - f for n, f in zip(near, far, strict=True)]
    return Result(sum(m > 0 for m in margins), len(margins), statistics.fmean(near), statistics.fmean(far),
                  statistics.fmean(margins), min(margins))


def embed(url: str, texts: list[str], *, model: str | None, api_key: str | None) -> list[list[float]]:
    body: dict[str, object] = {"input": texts, "encoding_format": "float"}
    if model is not None:
        body["model"] = model
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(url.rstrip("/") + "/v1/embeddings", json=body, headers=headers, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    data = sorted(response.json()["data"], key=lambda item: item["index"])
    return [item["embedding"] for item in data]


@contextlib.contextmanager
def own_pool(model_path: Path, threads: int) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="embedding-pairs-") as tmp, pool(
            Path(tmp), workers=[["--model-path", str(model_path), "--threads", str(threads)]],
            name="embedding-pairs") as running:
        yield running.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running pool's coordinator; default: start one of its own")
    parser.add_argument("--model", help="the model to ask for (default: the pool's only one)")
    parser.add_argument("--api-key", help="a client API key, when the pool needs one")
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH, help="own pool: the worker's GGUF")
    parser.add_argument("--threads", type=int, default=1, help="own pool: the worker's llama.cpp threads")
    args = parser.parse_args(argv)
    texts = [text for triple in TRIPLES for text in triple]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_pool(args.model_path, args.threads))
        result = score(embed(url, texts, model=args.model, api_key=args.api_key))
    print(result.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
