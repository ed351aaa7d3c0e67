"""Screenshot the page at / of a running `tiered serve` after one greedy chat message, in headless
Chromium (Debian's package) through Playwright. docs/serve_page_smollm2.png was taken this way:

    tiered serve --api-key secret --max-context 1024 &
    python scripts/page_screenshot.py docs/serve_page_smollm2.png --key secret --message "Name three colors."
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

from playwright.sync_api import sync_playwright

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--url", default="http://127.0.0.1:8000/")
    ap.add_argument("--key", default=None, help="the server's API key, if it has one")
    ap.add_argument("--message", default="Name three colors.")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=FLAGS,
                                                   viewport={"width": 1280, "height": 760})
        page = ctx.new_page()
        page.goto(args.url)
        if args.key:
            page.evaluate("key => localStorage.setItem('tiered-key', key)", args.key)
            page.reload()
        page.wait_for_function("document.getElementById('model').textContent !== 'connecting…'")
        page.fill("#temperature", "0")
        page.fill("#input", args.message)
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-done='1'], .msg.error", timeout=600_000)
        page.wait_for_timeout(2000)  # one more poll of /state
        page.screenshot(path=args.out)
        ctx.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
