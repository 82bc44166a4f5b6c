"""Headless Chromium (Playwright, Debian's /usr/bin/chromium) on a Prefect UI served from 127.0.0.1:
the screenshots of docs/ are taken by the tests that make the runs they show (test_ui_screenshot.py,
test_deployments.py), so they cannot drift from the code. DARE_UPDATE_DOCS=1 copies them into
docs/images/."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
DOCS_IMAGES = REPO / "docs" / "images"
CHROMIUM = os.environ.get("DARE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1440, "height": 1400}
UI_TIMEOUT_MS = 90_000  # the UI is a single-page app: JS load, then API calls, then rendering


def browser_missing() -> str | None:
    """Why no screenshot can be taken here (None: Chromium and playwright are installed)."""
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM} (install Debian's chromium: `make browser`)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (requirements/test.txt)"
    return None


# Scrolls the nearest scrollable ancestor of the first element matching the selector (the Prefect UI
# scrolls its main view, not the window) by most of a screen, or back to the top when it is at the
# bottom (so text above the current view is found too).
SCROLL_JS = """(selector) => {
    let el = document.querySelector(selector);
    while (el && !(el.scrollHeight > el.clientHeight + 5 && /auto|scroll/.test(getComputedStyle(el).overflowY)))
        el = el.parentElement;
    el = el || document.scrollingElement;
    if (el.scrollTop + el.clientHeight >= el.scrollHeight - 2) el.scrollTop = 0;
    else el.scrollBy(0, Math.max(200, el.clientHeight * 0.7));
}"""


def find_text(page, text: str, timeout_s: float, scroll: str | None = None) -> bool:
    """Wait until `text` is on the page. The Logs view renders its rows lazily (a virtual list),
    so with a `scroll` selector, scroll that element's view down a screen at a time meanwhile."""
    deadline = time.monotonic() + timeout_s
    locator = page.get_by_text(text).first
    while time.monotonic() < deadline:
        if locator.count() and locator.is_visible():
            return True
        if scroll is not None:
            page.evaluate(SCROLL_JS, scroll)
        page.wait_for_timeout(300)
    return False


def settle(page) -> None:
    """Let pending API calls finish and the run graph (a canvas) draw before a screenshot."""
    try:
        page.wait_for_load_state("networkidle", timeout=15_000)
    except Exception:  # the UI polls a running flow; a finished one goes quiet
        pass
    page.wait_for_timeout(1500)


@contextlib.contextmanager
def browser_page(profile: Path) -> Iterator:
    """A page of a fresh headless Chromium (dark, UTC, the docs' viewport)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport=VIEWPORT, device_scale_factor=1, color_scheme="dark", timezone_id="UTC",
        )
        try:
            page = context.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            context.close()


def screenshot(page, url: str, path: Path, must_show: list[str]) -> None:
    """Open `url`, wait until every text of `must_show` is on it, and save a full-page screenshot
    to `path` (also into docs/images/ with DARE_UPDATE_DOCS=1)."""
    page.goto(url, wait_until="domcontentloaded", timeout=UI_TIMEOUT_MS)
    missing = [text for text in must_show if not find_text(page, text, UI_TIMEOUT_MS / 1000)]
    assert not missing, f"not on {url}: {missing}\n{page.inner_text('body')[-3000:]}"
    page.mouse.move(0, 0)
    settle(page)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000, f"{path} is suspiciously small (a blank page?)"
    if os.environ.get("DARE_UPDATE_DOCS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_IMAGES / path.name)
