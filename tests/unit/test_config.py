"""parse_size and EngineArgs validation (no model needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pdserve.controlplane.registry import advertised_address
from pdserve.settings.engine import EngineArgs
from pdserve.settings.process import RegistrySettings
from pdserve.settings.sizes import parse_size


@pytest.mark.parametrize(
    "value, size",
    [
        ("2GiB", 2**31),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("100", 100),
        ("100B", 100),
        ("1kb", 1000),
        ("4KiB", 4096),
        ("1GB", 10**9),
        ("1.5GiB", 3 * 2**29),
        (" 2 gib ", 2**31),
        (4096, 4096),
    ],
)
def test_parse_size(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", ["", "abc", "GiB", "2TB", "2 GiBs", "1e9", "-1", "2.GiB", True])
def test_parse_size_rejects_bad_strings_naming_the_value(value):
    with pytest.raises(ValueError, match=re.escape(f"cannot read size {value!r}")):
        parse_size(value)


def test_engine_args_defaults_are_valid():
    args = EngineArgs()
    assert args.block_size == 16
    assert "max_num_seqs" in {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(block_size=12), "--block-size"),
        (dict(block_size=0), "--block-size"),
        (dict(dtype="fp8"), "--dtype"),
        (dict(device="tpu"), "--device"),
        (dict(device="cuda:x"), "--device"),
        (dict(attention_backend="x"), "--attention-backend"),
        (dict(max_num_seqs=0), "--max-num-seqs"),
        (dict(max_num_batched_tokens=0), "--max-num-batched-tokens"),
        (dict(num_kv_blocks=0), "--num-kv-blocks"),
        (dict(max_model_len=1), "--max-model-len"),
        (dict(num_threads=0), "--num-threads"),
        (dict(kv_cache_memory="0"), "--kv-cache-memory"),
        (dict(kv_cache_memory=-1), "--kv-cache-memory"),
    ],
)
def test_engine_args_reject_bad_values_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=f"^{re.escape(flag)} must"):
        EngineArgs(**kwargs)


def test_engine_args_unreadable_kv_cache_memory_names_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        EngineArgs(kv_cache_memory="lots")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=1),
        dict(block_size=32),
        dict(dtype="bfloat16"),
        dict(device="cpu"),
        dict(device="cuda:1"),
        dict(attention_backend="triton"),
        dict(kv_cache_memory="512MiB"),
        dict(kv_cache_memory=1),
        dict(max_model_len=2),
    ],
)
def test_engine_args_accept_good_values(kwargs):
    EngineArgs(**kwargs)


@pytest.mark.parametrize(
    "given,registered",
    [
        ("10.0.3.7:50081", "10.0.3.7:50081"),
        ("fd00::3:7:50081", "[fd00::3:7]:50081"),  # $(POD_IP):PORT on an IPv6 cluster
        ("[fd00::3:7]:50081", "[fd00::3:7]:50081"),
        ("decode-0.pdserve:50081", "decode-0.pdserve:50081"),
    ],
)
def test_an_advertised_address_is_registered_dialable(given, registered):
    assert advertised_address(RegistrySettings(advertise_address=given).advertise_address,
                              "0.0.0.0", 1) == registered  # fmt: skip


def test_a_bound_ipv6_host_is_registered_in_brackets():
    assert advertised_address(None, "::1", 50081) == "[::1]:50081"


@pytest.mark.parametrize("given", ["10.0.3.7", "pod-ip", "10.0.3.7:port", ":50081"])
def test_an_advertise_address_without_a_port_is_refused(given):
    with pytest.raises(ValueError, match="--advertise-address .* is not HOST:PORT"):
        RegistrySettings(advertise_address=given)
