import pytest
from pydantic import ValidationError

from worker.settings import WorkerSettings


def test_defaults_and_derived_values() -> None:
    s = WorkerSettings.load([], environ={})
    assert (s.port, s.worker_id, s.worker_url) == (3001, "worker-3001", "http://127.0.0.1:3001")
    assert s.ctx_size == s.max_sessions * s.session_max_tokens  # split KV: every session its own cells
    assert s.session_ttl == 300 and s.heartbeat_interval == 10


def test_flags_win_over_environment() -> None:
    env = {"WORKER_PORT": "3005", "WORKER_ID": "from-env", "MODEL_PATH": "/m.gguf", "WORKER_KV_UNIFIED": "1"}
    s = WorkerSettings.load(["--worker-id", "from-flag", "--no-kv-unified"], environ=env)
    assert (s.port, s.worker_id, str(s.model_path), s.kv_unified) == (3005, "from-flag", "/m.gguf", False)


def test_a_context_too_small_for_the_split_sessions_is_refused_not_clamped() -> None:
    with pytest.raises(ValidationError, match="256 KV cells, below session_max_tokens 512"):
        WorkerSettings.load(["--ctx-size", "1024", "--max-sessions", "4", "--session-max-tokens", "512"],
                            environ={})
    assert WorkerSettings.load(["--ctx-size", "1024", "--max-sessions", "4", "--session-max-tokens", "512",
                                "--kv-unified"], environ={}).ctx_size == 1024


def test_every_invalid_value_is_reported_at_once() -> None:
    with pytest.raises(ValidationError) as bad:
        WorkerSettings.load(["--port", "70000", "--threads", "0", "--session-ttl", "-1"], environ={})
    fields = {e["loc"][0] for e in bad.value.errors()}
    assert fields == {"port", "threads", "session_ttl"}


def test_gpu_layers_from_env_and_flag() -> None:
    assert WorkerSettings.load([], {"N_GPU_LAYERS": "0"}).gpu_layers == 0
    assert WorkerSettings.load(["--gpu-layers", "12"], {}).gpu_layers == 12
    assert WorkerSettings.load([], {}).gpu_layers == -1  # all layers where the build can offload, else none
    with pytest.raises(ValidationError):
        WorkerSettings.load(["--gpu-layers", "-2"], {})


def test_flash_attention_is_chosen_by_name_and_reaches_llama_cpps_context(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from worker.backends import llama_engine
    from worker.engine.jobs import EngineConfig
    from worker.runtime import FLASH_ATTN

    assert WorkerSettings.load([], environ={}).flash_attn == "auto"
    assert WorkerSettings.load(["--flash-attn", "off"], environ={"WORKER_FLASH_ATTN": "on"}).flash_attn == "off"
    with pytest.raises(ValidationError):
        WorkerSettings.load(["--flash-attn", "maybe"], environ={})
    made: list[int] = []

    def init(handle: object, params: object) -> None:
        made.append(params.flash_attn_type)  # type: ignore[attr-defined]

    monkeypatch.setattr(llama_engine.ll, "llama_init_from_model", init)
    model = types.SimpleNamespace(handle=None, kv_type=1)
    for name, value in FLASH_ATTN.items():
        with pytest.raises(RuntimeError):  # no context made: the parameters were all it needed to see
            llama_engine.Engine(model, EngineConfig(ctx_size=64, max_sessions=1, threads=1, flash_attn=value))  # type: ignore[arg-type]
        assert made[-1] == {"auto": -1, "off": 0, "on": 1}[name]
