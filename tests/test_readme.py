"""README's Python snippets run as pasted (issue 24: the low-level one raised ``NameError:
model``). Each ```python block runs alone in a fresh interpreter; the OpenAI-client one runs
against a live ``mlx-dgemma serve --demo`` (its URL's port swapped for a free one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
README_URL = "http://127.0.0.1:8080/v1"  # what the server snippet connects to (serve's defaults)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 3 and any("OpenAI(" in s for s in SNIPPETS)


def _serve(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """``serve --demo --port 0``; returns the process and its base URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)})
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            m = re.search(r"on (http://[\d.]+:\d+/v1)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(300)
    if not found:
        proc.kill()
        pytest.fail("serve --demo did not start")
    return proc, found[0]


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_pasted(index, tmp_path):
    code = SNIPPETS[index]
    server = None
    if "OpenAI(" in code:
        pytest.importorskip("openai")
        assert README_URL in code  # the snippet talks to serve's default address
        server, url = _serve(tmp_path)
        code = code.replace(README_URL, url)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                           env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)})
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    assert r.returncode == 0, f"README snippet {index} failed:\n{code}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), "the snippet printed nothing"


def test_readme_curl_examples_declare_json():
    # the server refuses a body not declared JSON (415), and `curl -d` alone declares a form
    text = README.read_text(encoding="utf-8")
    commands = re.findall(r"^curl .*?(?<!\\)$", text, re.M | re.S)
    posts = [c for c in commands if re.search(r"\s(-d|--data\S*)\s", c)]
    assert posts, "README's server section shows a curl request"
    for c in posts:
        assert "-H 'Content-Type: application/json'" in c, c
