"""Look at the built documentation site in a real browser: ``python .ci/check_site.py SITE OUT``.

Serves ``SITE`` (what ``mkdocs build`` wrote) on a local port, opens the home page and the API reference
in headless Chromium (Debian's ``chromium`` and ``chromedriver``, driven by selenium), writes a screenshot
of each to ``OUT``, and fails on a page with almost no text, a screenshot of one colour, or anything the
page logged to the browser console at level SEVERE (a script error, a missing asset).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import sys
import threading
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

PAGES = {"home": "", "api": "reference/"}
MIN_TEXT = 200  # characters of visible text on a page that rendered


def main(site: str, out: str) -> int:
    site_dir, out_dir = Path(site), Path(out)
    if not (site_dir / "index.html").exists():
        print(f"{site_dir}/index.html is missing: run 'make docs' first")
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = _browser()
    failures = []
    try:
        for name, path in PAGES.items():
            failures += _check(driver, f"http://127.0.0.1:{server.server_port}/{path}", out_dir / f"{name}.png", name)
    finally:
        driver.quit()
        server.shutdown()
    for failure in failures:
        print(failure)
    print("site check: " + ("FAILED" if failures else f"{len(PAGES)} pages rendered, screenshots in {out_dir}/"))
    return 1 if failures else 0


def _browser() -> webdriver.Chrome:
    """Headless Chromium, its console kept; Debian's binaries, so selenium downloads no driver."""
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))


def _check(driver: webdriver.Chrome, url: str, screenshot: Path, name: str) -> list[str]:
    """What is wrong with one page: too little text, a screenshot of one colour, console errors."""
    driver.get(url)
    driver.save_screenshot(str(screenshot))
    problems = []
    text = driver.execute_script("return document.body ? document.body.innerText : ''")
    if len(text.strip()) < MIN_TEXT:
        problems.append(f"{name} ({url}): blank page ({len(text.strip())} characters of text)")
    colours = Image.open(screenshot).convert("L").getextrema()
    if colours[0] == colours[1]:
        problems.append(f"{name} ({url}): the screenshot is one colour")
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE":
            problems.append(f"{name} ({url}): console error: {entry['message']}")
    return problems


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
