"""The docs against the code: every command they show parses with the real parsers, and
every link, path, module and variable they name exists (tests/helpers/docs_check.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.docs_check import ROOT, Problem, check, check_all, report
from tests.helpers.shell_commands import block_commands

PLANTED = """\
# Planted

## A heading

```sh
.venv/bin/pdserve up --no-such-flag
PDSERVE_LOG_LEVEL=DEBUG pdserve kvstore --port 0 \\
  --capacity-bytes lots &   # it's a bad size, continued, in the background
pdserve gateway --port 0 --disaggregation off --decode 127.0.0.1:1 | tee log   # fine
pdserve nosuch
pdserve up --prefill 0
make nosuch
make up ARGS="--decod 2"
make test NO_SUCH_VAR=1
curl -s http://127.0.0.1:8000/v1/nothing
curl http://127.0.0.1:8000/v1/completions -d '{"model": "m", "prompt": "x"'
grpcurl -plaintext 127.0.0.1:50051 pdserve.v1.Gateway/Nope
grpcurl -plaintext -d '{"no_such_field": 1}' 127.0.0.1:50051 pdserve.v1.Gateway/Generate
python -m pdserve.nosuch
python -m pdserve.config_docs --bogus
pdserve generate --max-tokens many "a prompt"
```

Fine: `pdserve generate --model /path/to/llama "Once"`, `pdserve up --http-port P`,
`pdserve COMMAND --help`, `pdserve bench serve --workload rewrite`, `pdserve gateway`,
`make up ARGS="--prefill 2"`, `services/engine/scheduler.py`, `pdserve.engine.scheduler`,
`bench/out/x.json`, `PDSERVE_MAX_NUM_SEQS=8`, `pdserve.worker.id`, `docs/*.md`.
Wrong: `pdserve up --prefil 2`, `services/nosuch.py`, `pdserve.nosuch.module`, `PDSERVE_NO_SUCH`.
Links: [ok](architecture.md), [ok](#a-heading), [bad](nosuch.md), [bad](#nowhere),
[bad](architecture.md#no-such-heading), [web](https://example.com/nowhere).
"""

# line -> what its problem says (a line may have several)
EXPECTED = {
    6: ["unrecognized arguments: --no-such-flag"],
    7: ["--capacity-bytes"],
    10: ["unknown command 'nosuch'"],
    11: ["--disaggregation on needs a prefill worker"],
    12: ["no make target 'nosuch'"],
    13: ["unrecognized arguments: --decod 2"],
    14: ["the Makefile does not use NO_SUCH_VAR"],
    15: ["no GET /v1/nothing"],
    16: ["the -d body is not JSON"],
    17: ["pdserve.v1.Gateway has no rpc Nope"],
    18: ["not a pdserve.v1.GenerateRequest", "no_such_field"],
    19: ["no module pdserve.nosuch"],
    20: ["unrecognized arguments: --bogus"],
    21: ["--max-tokens: invalid int value: 'many'"],
    28: ["--prefil", "services/nosuch.py", "pdserve.nosuch.module", "PDSERVE_NO_SUCH"],
    29: ["no file nosuch.md", "#nowhere"],
    30: ["architecture.md has no heading #no-such-heading"],
}


def test_every_kind_of_problem_is_found_at_its_line():
    problems = check(ROOT, "docs/planted.md", PLANTED)
    assert {p.path for p in problems} == {"docs/planted.md"}
    by_line: dict[int, list[str]] = {}
    for p in problems:
        by_line.setdefault(p.line, []).append(p.message)
    assert sorted(by_line) == sorted(EXPECTED), report(problems)
    for line, needles in EXPECTED.items():
        text = "\n".join(by_line[line])
        for needle in needles:
            assert needle in text, f"line {line}: {needle!r} not in {text!r}"
    assert len(by_line[28]) == 4 and len(by_line[29]) == 2, report(problems)


FINE = """\
## Start

```sh
R=redis://127.0.0.1:6379/0
TLS="--tls-cert svc.crt --tls-key svc.key"
export PDSERVE_INTERNAL_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
.venv/bin/pdserve kvstore --port 0 --redis-url $R $TLS &   # it's in the background
PDSERVE_MAX_NUM_SEQS=8 .venv/bin/pdserve decode --port 0 --redis-url $R \\
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' ...
make up ARGS="--prefill 2 --decode 2 --dtype float32"
curl -s http://127.0.0.1:8000/v1/chat/completions -d '{
  "model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
grpcurl -plaintext -d '{"prompt": "Hi", "params": {"max_tokens": 8}}' \\
  127.0.0.1:50051 pdserve.v1.Gateway/Generate
```

```
pdserve up: logs in /tmp/x
services/engine/   the engine
```

See [Start](#start), `helm/pdserve/`, `pdserve.config_docs`, `python -m pdserve.config_docs`.
"""


def test_a_doc_without_problems_has_none():
    assert check(ROOT, "docs/planted.md", FINE) == []


def test_a_block_is_read_as_the_shell_would():
    lines = FINE.split("```sh\n")[1].split("```")[0].splitlines()
    commands = block_commands("sh", 4, lines)
    assert commands[0].words == (
        *(".venv/bin/pdserve", "kvstore", "--port", "0"),
        *(
            "--redis-url",
            "redis://127.0.0.1:6379/0",
            "--tls-cert",
            "svc.crt",
            "--tls-key",
            "svc.key",
        ),
    )
    seen = [(c.line, c.words[0], dict(c.env), c.fragment) for c in commands]
    assert seen == [
        (7, ".venv/bin/pdserve", {}, False),  # the token is $(...): not known, so not set
        (8, ".venv/bin/pdserve", {"PDSERVE_MAX_NUM_SEQS": "8"}, True),
        (10, "make", {}, False),
        (11, "curl", {}, False),
        (13, "grpcurl", {}, False),
    ]
    assert commands[3].words[-1].startswith('{\n  "model"')  # the quote ran over two lines
    console = ["$ pdserve up --port 0", "pdserve up: logs in /tmp/x", "$ pdserve status"]
    assert [c.words for c in block_commands("console", 1, console)] == [
        ("pdserve", "up", "--port", "0"),
        ("pdserve", "status"),
    ]


def test_checking_imports_no_torch():
    """A command that needs torch (pdserve prefill) is parsed in a child process: the check's
    own stays free of it (this session's conftest imports torch, hence a process of its own)."""
    code = (
        "import sys\n"
        "from tests.helpers.docs_check import ROOT, check\n"
        "found = check(ROOT, 'docs/planted.md', sys.stdin.read())\n"
        "print(len(found), 'torch' in sys.modules)\n"
    )
    doc = "```sh\npdserve kvstore --port x\npdserve prefill --port x\n```\n"
    done = subprocess.run(
        [sys.executable, "-c", code], input=doc, capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.split() == ["2", "False"], done.stderr


def test_a_problem_names_its_file_and_line():
    assert str(Problem("README.md", 12, "broken")) == "README.md:12: broken"


def test_the_docs_commands_links_and_paths_hold():
    problems = check_all()
    assert not problems, report(problems)
