"""The page at / of `tiered serve`, in a real headless Chromium (Debian's package) driven by Playwright:
send a message, see the streamed answer equal the engine's, and the tier view update.

Skips when Chromium or Playwright is absent (.ci/run installs both). TIERED_PAGE_SCREENSHOT=FILE
keeps the screenshot (docs/serve_page.png was taken this way).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import CHAT_TEMPLATE
from test_serve import MODEL, running_server
from tiered import SamplingParams
from tiered.serve.engine import ServingEngine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser_page(tmp_path):
    """A fresh headless Chromium page (its own user-data dir), or a skip naming what is missing."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                       headless=True, args=FLAGS,
                                                       viewport={"width": 1280, "height": 760})
        try:
            yield context.new_page()
        finally:
            context.close()


def _greedy(llm, question: str):
    """The engine's own greedy answer, as the page asks for it (run before the server's KV cache exists)."""
    return llm.generate([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=256),
                        chat=True)[0]


def _chat_on_the_page(page, url: str, llm, question: str, ref) -> dict:
    """Open /, check the tier view, send `question` greedily; the streamed answer must equal `ref`
    and the tier view must come to count its tokens. Returns /state afterwards."""
    responses, errors = [], []
    page.on("response", lambda r: responses.append(r))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url + "/")
    page.wait_for_function(f"document.getElementById('model').textContent.includes('{MODEL}')")
    assert page.text_content("#binding") == llm.plan.binding
    assert page.text_content("#tokens") == "0"
    page.fill("#temperature", "0")
    page.fill("#input", question)
    page.press("#input", "Enter")
    answer = page.wait_for_selector(".msg.assistant[data-done='1']", timeout=60_000)
    assert answer.text_content() == ref.text and ref.text
    assert page.text_content(".msg.user") == question
    chat = [r for r in responses if r.url.endswith("/v1/chat/completions")]
    assert chat and chat[0].status == 200 and chat[0].headers["content-type"].startswith("text/event-stream")
    # the tier view polls /state: the tokens generated come to the answer's
    page.wait_for_function(f"document.getElementById('tokens').textContent === '{len(ref.token_ids)}'",
                           timeout=30_000)
    assert not errors, errors
    state = httpx.get(url + "/state").json()
    assert state["serving"]["generated_tokens"] == len(ref.token_ids) and state["served_model"] == MODEL
    return state


def _screenshot(page, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("TIERED_PAGE_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["TIERED_PAGE_SCREENSHOT"]).with_name(name))


def test_the_page_on_a_dense_model(browser_page, zoo, chat_llama, tmp_path):
    llm = zoo.llm(chat_llama)
    ref = _greedy(llm, "the quick brown fox")
    with running_server(ServingEngine(llm, max_batch=2, max_queue=4), None) as url:
        _chat_on_the_page(browser_page, url, llm, "the quick brown fox", ref)
        page = browser_page
        assert page.text_content("#placement-title") == "Weights per tier"
        assert page.text_content("#hit-rate") == "n/a"  # a dense model has no experts to hit
        assert "every weight" in page.text_content("#placement")
        _screenshot(page, tmp_path, "serve_page_dense.png")


def test_the_page_on_an_moe_model_under_a_budget(browser_page, zoo, tmp_path):
    """A tiny Mixtral (the tokenizer's vocabulary) behind the host stand-in: experts in CPU RAM and
    a 2-slot cache on the fast tier; the page shows experts per tier, hit rate and bytes per token."""
    from moe_fixtures import make_moe_checkpoint
    from runtime_fixtures import engine_config, sizes_of
    from tiered import LLM

    d = make_moe_checkpoint("mixtral", tmp_path / "mixtral-chat", vocab_size=zoo.vocab_size)
    tok = copy.deepcopy(zoo.tokenizer)  # the shared one stays without a template
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    s = sizes_of(d, max_context=128)
    # every miss copied: the balanced dispatcher may run them all on the CPU when the machine is busy
    # (a fresh-clone CI run saw 0 H2D bytes), and the page's link view is what this test is about
    llm = LLM(d, engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2), cpu_memory="64MiB",
                               expert_cache_slots=2, max_context=128, force_expert_path="copy"))
    try:
        ref = _greedy(llm, "the quick brown fox")
        # one KV slot: the planner plans the fast tier for one sequence's KV cache (and fills the rest)
        with running_server(ServingEngine(llm, max_batch=1, max_queue=4), None) as url:
            state = _chat_on_the_page(browser_page, url, llm, "the quick brown fox", ref)
            page = browser_page
            e = state["experts"]
            assert e["fast"] + e["cpu"] + e["disk"] == 2 * 8 and e["cache_slots"] == 2
            assert page.text_content("#placement-title") == "Experts per tier"
            page.wait_for_function(f"document.getElementById('hit-rate').textContent === "
                                   f"'{100 * e['hit_rate']:.1f}%'", timeout=30_000)
            assert f"{e['cpu']} of 16" in page.text_content("#placement")
            links = {l["link"]: l for l in state["links"]}
            assert links["host -> device (H2D)"]["bytes"] > 0  # misses were copied to the fast tier
            assert "/token" in page.text_content("#links")
            _screenshot(page, tmp_path, "serve_page_moe.png")
    finally:
        llm.close()
