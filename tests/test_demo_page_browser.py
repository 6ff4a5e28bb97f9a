"""The page of ``longreach serve-demo`` in headless Chromium, on the default model: load it, submit a document and a
question, read both answers from the page, take a screenshot.

Chromium and chromedriver come from Debian's packages (``make page-check`` installs them when missing, as
``make docs-check`` does). Without them the test is skipped, unless ``LONGREACH_REQUIRE_BROWSER=1`` (set by
``make page-check``) makes their absence a failure. ``LONGREACH_SCREENSHOTS`` names the folder for the screenshot.
"""

import os
import shutil
import threading
from pathlib import Path

import pytest

from longreach import demo_page
from longreach.methods.spec import MethodSpec

DOCUMENT = (
    "Notes from the harbour office. The boats left at dawn and came back at noon. The pass code for the gate is 58291. "
    "The nets were mended in the afternoon, and the market closed at six. "
) * 3
QUESTION = "What is the pass code for the gate?"


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("LONGREACH_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium and chromedriver are missing: make page-check installs them")
        pytest.skip("no chromium/chromedriver here (make page-check installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.page_load_strategy = "none"  # a submitted form loads while the model answers: wait for elements instead
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served():
    """The page on the default model, served on a free local port by a thread."""
    from werkzeug.serving import make_server

    import longreach
    from longreach import models

    model, tokenizer = models.load("default")
    methods = [MethodSpec.parse("rope"), MethodSpec.parse("string")]
    app = demo_page.create_app(
        model, tokenizer, "default", longreach.training_window(model.config), methods, max_new_tokens=16
    )
    server = make_server("127.0.0.1", 0, app, threaded=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


@pytest.mark.slow
def test_the_page_answers_a_question_about_a_pasted_document_in_a_browser(
    served, browser, tmp_path
):  # browser closes first
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 600)
    browser.get(served)
    wait.until(expected_conditions.presence_of_element_located((By.ID, "ask")))
    assert "STRING on your document" in browser.title
    browser.execute_script("document.getElementById('document').value = arguments[0];", DOCUMENT)  # pasted, not typed
    browser.find_element(By.ID, "question").send_keys(QUESTION)
    browser.find_element(By.ID, "ask").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "answer-1")))
    answers = {
        browser.find_element(By.CSS_SELECTOR, f"#answer-{i} h2").text: browser.find_element(
            By.CSS_SELECTOR, f"#answer-{i} .text"
        ).text
        for i in (0, 1)
    }
    assert set(answers) == {"rope", "string"} and all(text.strip() for text in answers.values())
    assert "58291" in answers["rope"] and "58291" in answers["string"]  # a short document: both find it
    assert "inside the model's window L = 8,192" in browser.find_element(By.ID, "reading").text
    shots = Path(os.environ.get("LONGREACH_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shots / "demo_page.png"))
    severe = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
