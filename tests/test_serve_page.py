"""The page at / of `tiered serve`, in a real headless Chromium (Debian's package) driven by Playwright:
send a message, see the streamed answer equal the engine's, and the tier view update.

Skips when Chromium or Playwright is absent (.ci/run installs both). TIERED_PAGE_SCREENSHOT=FILE
keeps the screenshot (docs/serve_page.png was taken this way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

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


def test_the_page_chats_and_shows_the_tiers(browser_page, zoo, chat_llama, tmp_path):
    page = browser_page
    llm = zoo.llm(chat_llama)
    question = "the quick brown fox"
    ref = llm.generate([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=256),
                       chat=True)[0]
    engine = ServingEngine(llm, max_batch=2, max_queue=4)
    with running_server(engine, None) as url:
        responses = []
        page.on("response", lambda r: responses.append(r))
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(url + "/")
        try:
            page.wait_for_function("document.getElementById('model').textContent.includes('tiny-llama')")
        finally:
            assert not errors, errors
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
        state = httpx.get(url + "/state").json()
        assert state["serving"]["generated_tokens"] == len(ref.token_ids) and state["served_model"] == MODEL
        assert page.text_content("#placement-title") == "Weights per tier"
        assert page.text_content("#hit-rate") == "n/a"  # a dense model has no experts to hit
        assert "every weight" in page.text_content("#placement")
        shot = tmp_path / "serve_page.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("TIERED_PAGE_SCREENSHOT"):
            shutil.copy(shot, Path(os.environ["TIERED_PAGE_SCREENSHOT"]))
