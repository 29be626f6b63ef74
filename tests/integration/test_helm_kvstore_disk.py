"""The Helm chart's kvstore disk tier (kvstore.disk): off by default; on, the kvstore gets
--disk-path on an emptyDir of its own size limit and --disk-capacity-bytes."""

from __future__ import annotations

from tests.helpers.helm_chart import of_kind, render, template


def kvstore_pod(docs: list[dict]) -> dict:
    (deployment,) = [d for n, d in of_kind(docs, "Deployment").items() if n.endswith("kvstore")]
    return deployment["spec"]["template"]["spec"]


def test_the_kvstore_has_no_disk_tier_unless_asked():
    pod = kvstore_pod(render())
    assert not [a for a in pod["containers"][0]["args"] if a.startswith("--disk-")]
    assert "kvstore-disk" not in [v["name"] for v in pod["volumes"]]


def test_a_disk_tier_is_an_emptydir_mounted_where_disk_path_points():
    pod = kvstore_pod(
        render(set_values={"kvstore.disk.enabled": True, "kvstore.disk.capacityBytes": "2GiB"})
    )
    (container,) = pod["containers"]
    assert [a for a in container["args"] if a.startswith("--disk-")] == [
        "--disk-path=/var/lib/pdserve/kvstore-disk",
        "--disk-capacity-bytes=2GiB",
    ]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["kvstore-disk"] == "/var/lib/pdserve/kvstore-disk"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvstore-disk"]["emptyDir"] == {"sizeLimit": "9Gi"}


def test_the_schema_refuses_a_bad_disk_capacity():
    done = template(set_values={"kvstore.disk.capacityBytes": "lots"}, check=False)
    assert done.returncode != 0 and "/kvstore/disk/capacityBytes" in done.stderr, done.stderr
