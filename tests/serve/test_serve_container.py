"""deploy/Dockerfile: `sartor serve` on all addresses, runtime dependencies only, and its HEALTHCHECK
command run against a real server (healthy while it serves, unhealthy once it is gone). Building
the image needs Docker, which the tests do not assume."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from release_helpers import start_server, stop
from serve_helpers import BATCHING, add_model

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile"


def test_the_image_serves_on_all_addresses_with_runtime_dependencies_only():
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    assert 'ENTRYPOINT ["python", "-m", "sartor", "serve"]' in text
    assert '"--host", "0.0.0.0"' in text and '"--model-repository", "/models"' in text
    install = next(line for line in text.splitlines() if line.startswith("RUN pip install"))
    assert '".[serve]"' in install and "test" not in install and "--constraint requirements.lock" in install
    assert "STOPSIGNAL SIGTERM" in text and "USER sartor" in text


def test_the_healthcheck_follows_the_servers_readiness(tiny_plan, tmp_path):
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    match = re.search(r'HEALTHCHECK [^\n]*?CMD python -c "([^"]+)"', text)
    assert match and "/v2/health/ready" in match.group(1)
    add_model(tmp_path / "repo", "tiny", tiny_plan, BATCHING)
    server, port = start_server(tmp_path / "repo")
    check = [sys.executable, "-c", match.group(1).replace("127.0.0.1:8000", f"127.0.0.1:{port}")]
    try:
        assert subprocess.run(check, capture_output=True, timeout=60, check=False).returncode == 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        assert subprocess.run(check, capture_output=True, timeout=60, check=False).returncode != 0
    finally:
        stop(server)
