"""Look at the built documentation site in a real browser: ``python .ci/check_site.py SITE OUT``.

Serves ``SITE`` (what ``mkdocs build`` wrote) on a local port and opens every page of it (each ``.html``
file) in headless Chromium (Debian's ``chromium`` and ``chromedriver``, driven by selenium). Each page gets a
screenshot in ``OUT``, and fails on:

* almost no text, or a screenshot of one colour (a page that did not render);
* an image that did not load (a wrong path, or a file that is not an image);
* an internal link whose target is not served, or whose ``#anchor`` is on no element of the target page;
* anything the page logged to the browser console at level SEVERE (a script error, a missing asset).

External links are not followed: the site is checked offline.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urldefrag

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

MIN_TEXT = 200  # characters of visible text on a page that rendered
IMAGES = "return Array.from(document.images, i => [i.currentSrc || i.src, i.complete && i.naturalWidth > 0])"
LINKS = "return Array.from(document.querySelectorAll('a[href]'), a => a.href)"


def main(site: str, out: str) -> int:
    site_dir, out_dir = Path(site), Path(out)
    if not (site_dir / "index.html").exists():
        print(f"{site_dir}/index.html is missing: run 'make docs' first")
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = sorted(path.relative_to(site_dir).as_posix() for path in site_dir.rglob("*.html"))
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_port}/"
    start, counts, failures = time.monotonic(), {"images": 0, "links": 0}, []
    driver = _browser()
    try:
        for page in pages:
            url = root + re.sub(r"(^|/)index\.html$", r"\1", page)
            failures += _check(driver, url, root, out_dir / _screenshot_name(page), counts)
    finally:
        driver.quit()
        server.shutdown()
    for failure in failures:
        print(failure)
    seconds = time.monotonic() - start
    print(
        f"site check: {'FAILED' if failures else 'passed'}: {len(pages)} pages, {counts['images']} images, "
        f"{counts['links']} internal links checked in {seconds:.0f} s; screenshots in {out_dir}/"
    )
    return 1 if failures else 0


def _browser() -> webdriver.Chrome:
    """Headless Chromium, its console kept; Debian's binaries, so selenium downloads no driver."""
    options = webdriver.ChromeOptions()
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))


def _check(driver: webdriver.Chrome, url: str, root: str, screenshot: Path, counts: dict) -> list[str]:
    """What is wrong with one page: too little text, one colour, broken images and links, console errors."""
    driver.get(url)
    driver.save_screenshot(str(screenshot))
    problems = []
    text = driver.execute_script("return document.body ? document.body.innerText : ''")
    if len(text.strip()) < MIN_TEXT:
        problems.append(f"{url}: blank page ({len(text.strip())} characters of text)")
    colours = Image.open(screenshot).convert("L").getextrema()
    if colours[0] == colours[1]:
        problems.append(f"{url}: the screenshot is one colour")
    broken_images = set()
    for source, loaded in driver.execute_script(IMAGES):
        counts["images"] += 1
        if not loaded:
            broken_images.add(source)
            problems.append(f"{url}: image {source} did not load")
    for link in sorted(set(driver.execute_script(LINKS))):
        if link.startswith(root):
            counts["links"] += 1
            problem = _broken(link)
            if problem:
                problems.append(f"{url}: link {link}: {problem}")
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE" and entry["message"].split(" ")[0] not in broken_images:  # said once above
            problems.append(f"{url}: console error: {entry['message']}")
    return problems


def _broken(link: str) -> str | None:
    """Why an internal link does not load (its target not served, or its anchor not on the target), or None."""
    target, anchor = urldefrag(link)
    body = _fetch(target)
    if body is None:
        return "not found"
    if anchor and unquote(anchor) not in _anchors(target):
        return f"no element with id {unquote(anchor)!r} on {target}"
    return None


@functools.cache
def _fetch(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read()
    except urllib.error.URLError:
        return None


@functools.cache
def _anchors(url: str) -> frozenset[str]:
    return frozenset(re.findall(r'\b(?:id|name)="([^"]+)"', (_fetch(url) or b"").decode("utf-8", "replace")))


def _screenshot_name(page: str) -> str:
    """``index.html`` -> ``home.png``; ``study/window/summary/index.html`` -> ``study-window-summary.png``."""
    stem = re.sub(r"(^|/)index\.html$", "", page).removesuffix(".html").strip("/").replace("/", "-")
    return (stem or "home") + ".png"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
