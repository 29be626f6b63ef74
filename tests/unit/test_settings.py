"""The one settings mechanism: every class's flags, variables and defaults come from its
dataclass fields; variables set defaults, flags win, bad values and misspelled variables
are named; every service's --help has the same layout."""

from __future__ import annotations

import dataclasses
import logging
import typing

import pytest

from pdserve.engine.cli import parse_generate_args
from pdserve.settings.commands import ALL_SETTINGS, UpSettings, known_env
from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import build_parser, options, parse_settings, to_argv, warn_unknown_env
from pdserve.settings.services import (
    DecodeSettings,
    GatewaySettings,
    KVStoreSettings,
    OpenAISettings,
    PrefillSettings,
)

SERVICES = (GatewaySettings, PrefillSettings, DecodeSettings, KVStoreSettings)


def expected_options(cls, defaults=None, prefix=()):
    """(path, flag, env, default) of every leaf field, walking the dataclasses by hand."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        if dataclasses.is_dataclass(hints[f.name]):
            yield from expected_options(hints[f.name], default, (*prefix, f.name))
        else:
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            yield (*prefix, f.name), flag, "PDSERVE_" + f.name.upper(), default


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.__name__)
def test_flags_env_names_and_defaults_follow_the_dataclass(cls, monkeypatch):
    for o in options(
        cls
    ):  # a variable set by whoever runs the tests (PDSERVE_HOME) is not a default
        monkeypatch.delenv(o.env, raising=False)
    got = [(o.path, o.flag, o.env, o.default) for o in options(cls)]
    assert got == list(expected_options(cls))
    parser = build_parser(cls, "p", "")
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for path, flag, env, default in got:
        action = actions[flag]
        assert action.dest == "__".join(path)
        assert action.default == default, flag
        assert env in action.help, flag
    # Flags are unique within a command; names of the same field mean the same everywhere.
    assert len({o.flag for o in options(cls)}) == len(got)


def test_per_service_defaults_come_from_the_nested_default():
    ports = {cls: next(o for o in options(cls) if o.flag == "--port").default for cls in SERVICES}
    assert ports == {
        GatewaySettings: 50051,
        PrefillSettings: 50071,
        DecodeSettings: 50081,
        KVStoreSettings: 50061,
    }


def test_environment_sets_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PDSERVE_ENABLE_PREFIX_CACHING", "off")
    monkeypatch.setenv("PDSERVE_DRAIN_TIMEOUT", "2.5")
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    s = parse_settings(DecodeSettings, [], "p", "")
    assert s.engine.max_num_seqs == 7 and s.engine.enable_prefix_caching is False
    assert s.server.drain_timeout == 2.5 and s.log.log_format == "json"
    assert s.registry.redis.redis_url == "redis://127.0.0.1:1/0"
    s = parse_settings(DecodeSettings, ["--max-num-seqs", "9", "--enable-prefix-caching"], "p", "")
    assert s.engine.max_num_seqs == 9 and s.engine.enable_prefix_caching is True


def test_repeatable_flags_replace_the_variables_list(monkeypatch):
    monkeypatch.setenv("PDSERVE_DECODE_ADDRS", "127.0.0.1:1, 127.0.0.1:2")
    s = parse_settings(GatewaySettings, ["--disaggregation", "off"], "p", "")
    assert s.decode_addrs == ("127.0.0.1:1", "127.0.0.1:2")
    argv = ["--no-disaggregation", "--decode", "127.0.0.1:3", "--decode", "127.0.0.1:4"]
    s = parse_settings(GatewaySettings, argv, "p", "")
    assert s.decode_addrs == ("127.0.0.1:3", "127.0.0.1:4") and not s.disaggregation


@pytest.mark.parametrize(
    ("env", "value", "named"),
    [
        ("PDSERVE_MAX_NUM_SEQS", "many", "PDSERVE_MAX_NUM_SEQS='many'"),
        ("PDSERVE_ENABLE_PREFIX_CACHING", "maybe", "PDSERVE_ENABLE_PREFIX_CACHING='maybe'"),
        ("PDSERVE_LOG_FORMAT", "xml", "PDSERVE_LOG_FORMAT"),
        ("PDSERVE_BLOCK_SIZE", "12", "--block-size must be a power of two"),
        ("PDSERVE_ROOT_PATH", "llm", "--root-path must be a path such as /llm"),
        ("PDSERVE_ROOT_PATH", "/", "--root-path must be a path such as /llm"),
        ("PDSERVE_ROOT_PATH", "/a b", "--root-path must be a path such as /llm"),
    ],
)
def test_a_bad_variable_exits_2_naming_it(monkeypatch, capsys, env, value, named):
    monkeypatch.setenv(env, value)
    cls, argv = (DecodeSettings, [])
    if env == "PDSERVE_ROOT_PATH":
        cls, argv = (GatewaySettings, ["--no-disaggregation", "--decode", "127.0.0.1:1"])
    with pytest.raises(SystemExit) as raised:
        parse_settings(cls, argv, "pdserve x", "")
    assert raised.value.code == 2
    assert named in capsys.readouterr().err


def test_a_bad_flag_exits_2_with_the_checks_message(capsys):
    with pytest.raises(SystemExit) as raised:
        parse_settings(KVStoreSettings, ["--capacity-bytes", "lots"], "pdserve kvstore", "")
    assert raised.value.code == 2
    assert "--capacity-bytes: cannot read size 'lots'" in capsys.readouterr().err


def test_misspelled_variables_are_warned_about_with_a_suggestion(caplog):
    environ = {
        "PDSERVE_MAX_NUM_SEQ": "4",  # misspelled
        "PDSERVE_DTYPE": "float32",  # an engine setting: known, even to the gateway
        "PDSERVE_HOME": "/tmp",
        "OTHER": "x",
    }
    with caplog.at_level(logging.WARNING):
        assert warn_unknown_env(known_env(), environ) == ["PDSERVE_MAX_NUM_SEQ"]
    assert "PDSERVE_MAX_NUM_SEQ is not a pdserve setting" in caplog.text
    assert "did you mean PDSERVE_MAX_NUM_SEQS?" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        PrefillSettings(kvstore="127.0.0.1:9", engine=EngineArgs(dtype="bfloat16", seed=3)),
        DecodeSettings(engine=EngineArgs(enable_prefix_caching=False, max_model_len=512)),
        KVStoreSettings(capacity_bytes="3MiB"),
        GatewaySettings(decode_addrs=("a:1", "b:2"), disaggregation=False, api_key="k"),
        GatewaySettings(
            decode_addrs=("a:1",), disaggregation=False, openai=OpenAISettings(root_path="/llm")
        ),
        UpSettings(num_prefill=2, engine=EngineArgs(num_kv_blocks=64)),
    ],
    ids=lambda s: type(s).__name__,
)
def test_to_argv_gives_back_the_same_settings(settings):
    assert parse_settings(type(settings), to_argv(settings), "p", "") == settings


def test_secrets_stay_out_of_reprs_and_help():
    settings = GatewaySettings(decode_addrs=("a:1",), disaggregation=False, api_key="s3cret")
    assert "s3cret" not in repr(settings)
    help_text = build_parser(GatewaySettings, "p", "").format_help()
    assert "--api-key" in help_text and "(hidden)" in help_text


@pytest.mark.parametrize("cls", SERVICES, ids=lambda c: c.__name__)
def test_every_service_help_has_the_same_layout(cls):
    text = build_parser(cls, "pdserve x", "What it does.").format_help()
    sections = [line[:-1] for line in text.splitlines() if line and line[0] != " " and
                line.endswith(":")]  # fmt: skip
    assert sections[:2] == ["options", "server"]
    assert sections[-1] == "logging"
    assert "control plane" in sections
    assert "Every flag can also be set by the environment variable" in text
    flags = [o.flag for o in options(cls)]
    assert all(f"{o.env};" in text for o in options(cls)), flags


# -- bool flags: switches, with a value after "=" ---------------------------------------


def test_generate_chat_keeps_the_prompt_after_it():
    settings, prompts = parse_generate_args(["--chat", "Write a haiku about GPUs."])
    assert settings.chat is True and prompts == ["Write a haiku about GPUs."]
    settings, prompts = parse_generate_args(["--chat", "off"])  # a prompt, too
    assert settings.chat is True and prompts == ["off"]


@pytest.mark.parametrize(
    ("argv", "chat"),
    [
        (["--chat=false", "p"], False),
        (["--chat=on", "p"], True),
        (["--no-chat", "p"], False),
        (["p", "--chat"], True),
        (["--chat", "--", "p"], True),
    ],
)
def test_a_bool_flag_takes_a_value_only_after_equals_beside_prompts(argv, chat):
    settings, prompts = parse_generate_args(argv)
    assert settings.chat is chat and prompts == ["p"]


def test_a_bool_variable_still_reads_true_and_false(monkeypatch):
    monkeypatch.setenv("PDSERVE_CHAT", "true")
    assert parse_generate_args(["p"])[0].chat is True
    monkeypatch.setenv("PDSERVE_CHAT", "false")
    assert parse_generate_args(["p"])[0].chat is False


@pytest.mark.parametrize(
    ("argv", "on"),
    [
        (["--disaggregation", "off"], False),  # as scripts and docs write it
        (["--disaggregation=no"], False),
        (["--no-disaggregation"], False),
        (["--disaggregation", "--decode", "2"], True),
        (["--disaggregation", "true", "--decode", "2"], True),
    ],
)
def test_without_positionals_the_word_after_a_bool_flag_is_its_value(argv, on):
    assert parse_settings(UpSettings, argv, "pdserve up", "").disaggregation is on


@pytest.mark.parametrize(
    "argv", [["--disaggregation", "maybe"], ["--disaggregation=maybe"], ["--no-disaggregation=1"]]
)
def test_a_bad_bool_value_exits_2_naming_the_flag(capsys, argv):
    with pytest.raises(SystemExit) as raised:
        parse_settings(UpSettings, argv, "pdserve up", "")
    assert raised.value.code == 2
    assert "disaggregation" in capsys.readouterr().err
