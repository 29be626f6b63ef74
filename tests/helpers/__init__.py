"""What the tests share and only the tests use: the fixtures (``fixtures``, a pytest plugin
that tests/conftest.py registers), the engine flags every worker runs with (``flags``), the
shapes of cluster they serve from (``clusters``), fake workers and a fake kvstore on real
sockets (``fake_workers``, ``kv_blocks``), the OpenAI error shape (``openai_errors``), the
import trace of a start (``import_trace``), TLS certificates (``tls_certs``), the Helm
chart rendered, validated and run as local processes (``helm_chart``, ``k8s_validate``,
``chart_pods``), the tiny model's planner profile (``planner_profile``), and what the docs show, checked (``docs_check``, ``shell_commands``,
``command_checks``, ``parse_only``).

What benchmarks use as well lives in ``pdserve.testing``. No test module imports another:
tests/unit/test_test_layout.py checks it."""
