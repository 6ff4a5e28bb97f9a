"""``longreach serve-demo``: a local web page where a person pastes or uploads a document, asks a question, and reads
RoPE's and STRING's answers side by side (:mod:`longreach.ask` does the work).

Built on Flask: a form and a page of answers need no more, it runs with no network at all (no fonts, scripts or
telemetry fetched from elsewhere), and it is small and long maintained. Gradio, which the official STRING demo uses,
was the first choice; its current release pins Pillow below the version this project's stack runs and brings some
fifteen packages for a page that posts one form. The model answers one question at a time (one worker thread).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import ask

MAX_UPLOAD = 32 * 1024 * 1024  # bytes

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>longreach: STRING on your document</title>\
<link rel="icon" href="data:,">
<style>
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 70rem; padding: 0 1rem; color: #222; }
textarea, input[type=text] { width: 100%; box-sizing: border-box; font: inherit; }
textarea { height: 14rem; } .answers { display: flex; gap: 1rem; } \
.answer { flex: 1; border: 1px solid #ccc; padding: 0 1rem 1rem; }
.answer pre { white-space: pre-wrap; font: inherit; } .error { color: #b00; } .note { color: #555; }
</style></head><body>
<h1>STRING on your document</h1>
<p class="note">{{ model }}: window L = {{ window }} tokens. Each method answers the same prompt, greedily; only the \
positions
differ. Beyond STRING's shift S = {{ shift }} tokens from the question, STRING reads a fact at a shifted, better \
trained position.</p>
<form method="post" enctype="multipart/form-data">
<p><label for="document">Document (paste it, or upload a .txt, .md or .pdf file below)</label>
<textarea id="document" name="document">{{ document }}</textarea></p>
<p><label for="file">File</label> <input type="file" id="file" name="file" accept=".txt,.md,.markdown,.pdf"></p>
<p><label for="question">Question</label> <input type="text" id="question" name="question" value="{{ question }}"></p>
<p><button type="submit" id="ask">Ask each method</button></p>
</form>
{% if error %}<p class="error" id="error">{{ error }}</p>{% endif %}
{% if reading %}<p class="note" id="reading">{{ reading }}</p>
<div class="answers">{% for answer in answers %}
<div class="answer" id="answer-{{ loop.index0 }}"><h2>{{ answer.method }}</h2><pre class="text">{{ answer.text }}</pre>
<p class="note">{{ '%.1f' % answer.seconds }} s; {{ answer.where }}</p><p class="note">{{ answer.described }}</p></div>
{% endfor %}</div>{% endif %}
</body></html>"""


def create_app(model, tokenizer, model_name: str, window: int, methods: list, max_new_tokens: int = ask.MAX_NEW_TOKENS):
    """The Flask application: ``GET /`` the form, ``POST /`` the form with each method's answer."""
    from flask import Flask, render_template_string, request

    app = Flask("longreach.demo_page")
    app.config["MAX_CONTENT_LENGTH"] = MAX_UPLOAD
    shift = ask.string_shift(window)

    def blank() -> dict:
        return {
            "model": model_name,
            "window": f"{window:,}",
            "shift": f"{shift:,}",
            "document": "",
            "question": "",
            "error": None,
            "reading": None,
            "answers": [],
        }

    @app.errorhandler(413)
    def too_large(error):
        fields = {**blank(), "error": f"the upload is over {MAX_UPLOAD // (1024 * 1024)} MB: give a smaller file"}
        return render_template_string(PAGE, **fields), 413

    @app.route("/", methods=["GET", "POST"])
    def page():
        fields = blank()
        if request.method == "POST":
            fields["document"], fields["question"] = request.form.get("document", ""), request.form.get("question", "")
            try:
                document = _uploaded(request.files.get("file")) or fields["document"]
                if not document.strip():
                    raise ValueError("no document: paste one, or upload a .txt, .md or .pdf file")
                text, read = ask.reading(tokenizer, window, document, fields["question"], max_new_tokens)
                fields["reading"] = read.describe()
                fields["answers"] = [
                    _shown(answer, tokenizer, document, shift)
                    for answer in ask.answers(model, tokenizer, text, methods, window, max_new_tokens)
                ]
                fields["document"] = document
            except ValueError as error:
                fields["error"] = str(error)
        return render_template_string(PAGE, **fields)

    return app


def _uploaded(upload) -> str | None:
    """The text of an uploaded file (read by :func:`longreach.ask.read_document`), or ``None`` without one."""
    if upload is None or not upload.filename:
        return None
    suffix = Path(upload.filename).suffix
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"upload{suffix}"
        upload.save(path)
        try:
            return ask.read_document(path)
        except ValueError as error:  # name the file the person chose, not the temporary one
            raise ValueError(str(error).replace(str(path), upload.filename)) from None


def _shown(answer: ask.Answer, tokenizer, document: str, shift: int) -> dict:
    distance = ask.distance_to_question(tokenizer, document, answer.text)
    if distance is None:
        where = "its words are not in the document"
    else:
        side = "beyond S: STRING shifts it" if distance >= shift else "within S: the same position for both"
        where = f"its words stand {distance:,} tokens before the question ({side})"
    return {
        "method": answer.method,
        "text": answer.text or "(nothing)",
        "seconds": answer.seconds,
        "where": where,
        "described": answer.described,
    }


def serve(
    model_name: str, methods: list, host: str = "127.0.0.1", port: int = 7860, max_new_tokens: int = ask.MAX_NEW_TOKENS
) -> None:
    """Load the model once (:func:`longreach.ask.load`), set it up before any answer is timed
    (:func:`longreach.ask.warm_up`), and serve the page until Ctrl-C."""
    from .eval.generate import set_up_line

    model, tokenizer, window = ask.load(model_name, methods)
    print(set_up_line(ask.warm_up(model, methods, window)), flush=True)
    app = create_app(model, tokenizer, model_name, window, methods, max_new_tokens)
    print(
        f"longreach: serving {model_name} (L = {window:,}) with {', '.join(m.label for m in methods)} "
        f"at http://{host}:{port}/ (Ctrl-C stops it)",
        flush=True,
    )
    app.run(host=host, port=port, threaded=False)
