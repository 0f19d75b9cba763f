"""The OpenAI Batch API's jobs: the embedded store of files and batches (store.py), the lines of a
batch (lines.py), and the runner that runs them on the pool's idle capacity (runner.py)."""
