"""The chat page in headless Chromium (Debian's, driven by Playwright): type a message, see a streamed reply."""
from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.mark.slow
def test_chat_page_streams_a_reply(server_url, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM) and not __import__("os").path.exists(CHROMIUM):
        pytest.skip("no chromium: run scripts/system-deps.sh")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server_url + "/")
            page.click("summary")                    # the settings panel
            page.fill("#max_tokens", "12")
            page.fill("#system", "Be brief.")           # a short prompt: SmolLM2's default system text is longer
            page.fill("#msg", "Say hello.")
            page.press("#msg", "Enter")
            page.wait_for_selector(".assistant[data-done='1']", timeout=120_000)
            reply = page.inner_text(".assistant")
            chunks = int(page.get_attribute(".assistant", "data-chunks"))
            classes = page.get_attribute(".assistant", "class")
            stats = page.inner_text("#stats")
            page.screenshot(path=str(tmp_path / "chat.png"))
            # a second turn carries the conversation
            page.fill("#msg", "Again.")
            page.click("#send")
            page.wait_for_selector(".assistant >> nth=1", timeout=10_000)
            page.wait_for_function("document.querySelectorAll(\".assistant[data-done='1']\").length == 2",
                                   timeout=120_000)
            n_user = page.locator(".user").count()
        finally:
            browser.close()
    assert not errors and "error" not in classes
    assert reply.strip() and chunks > 1          # streamed: the reply grew over several chunks
    assert "tokens/s" in stats and n_user == 2
