"""The chat page in headless Chromium (Debian's, driven by Playwright): type a message, see a streamed reply."""
from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.slow
def test_chat_page_streams_a_reply(server_url, tmp_path):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page()
        page.goto(server_url + "/")
        page.fill("#msg", "Say hello.")
        page.click("#send")
        page.wait_for_selector(".assistant[data-done='1']", timeout=120_000)
        reply = page.inner_text(".assistant")
        page.screenshot(path=str(tmp_path / "chat.png"))
        browser.close()
    assert len(reply.strip()) > 0
