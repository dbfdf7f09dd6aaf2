"""tessera's msc:// paths against NVIDIA's multi-storage-client (MSC) 1.3.1 itself, on moto
(tessera_moto_server: S3 on loopback, signatures enforced).

The configs are written the way MSC documents them (profiles, an S3 storage provider with an
endpoint, S3Credentials), as YAML and as JSON, and the tests check that `msc://profile/path`
names the same objects in both: a checkpoint tessera saves is listed and read back byte for byte
with MSC's own API (and with boto3, to see the keys); a checkpoint written through MSC (DCP's
storage layer from MSC, and Megatron-Core's dist_checkpointing with its MSC feature on) loads
with tessera. Where tessera would address other objects than MSC, or MSC refuses a config, tessera
refuses it too, naming what."""

import contextlib
import datetime
import json
import os
import uuid
from typing import Any, Dict, Iterator, List

import boto3
import multistorageclient as msc
import pytest
import torch
import yaml

import tessera
from conftest import free_port, moto_server

AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


@pytest.fixture(scope="module")
def server() -> Iterator[Dict[str, str]]:
    """moto's variables (AWS_ACCESS_KEY_ID, ..., AWS_ENDPOINT_URL, TESSERA_TEST_BUCKET)."""
    with moto_server() as values:
        yield values


@pytest.fixture
def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the AWS environment: the MSC config alone must reach the server."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


def profile_config(server: Dict[str, str], base_path: str, **extra: Any) -> Dict[str, Any]:
    """One MSC profile of the S3 provider on moto, as MSC's configuration reference shows it."""
    profile: Dict[str, Any] = {
        "storage_provider": {
            "type": "s3",
            "options": {"base_path": base_path, "endpoint_url": server["AWS_ENDPOINT_URL"],
                        "region_name": server.get("AWS_REGION", "us-east-1"),
                        "s3": {"addressing_style": "path"}},
        },
        "credentials_provider": {
            "type": "S3Credentials",
            "options": {"access_key": server["AWS_ACCESS_KEY_ID"],
                        "secret_key": server["AWS_SECRET_ACCESS_KEY"]},
        },
    }
    profile.update(extra)
    return profile


def write_config(directory: str, fmt: str, profiles: Dict[str, Any]) -> str:
    """Writes {"profiles": profiles} as `fmt` ("yaml" or "json"); returns the file's path."""
    path = os.path.join(directory, f"msc_config.{fmt}")
    with open(path, "w") as f:
        if fmt == "json":
            json.dump({"profiles": profiles}, f, indent=2)
        else:
            yaml.safe_dump({"profiles": profiles}, f)
    return path


def unique_profile() -> str:
    """A profile name of its own: MSC caches one client per profile name for the process."""
    return "t" + uuid.uuid4().hex[:10]


def s3_keys(server: Dict[str, str], prefix: str) -> Dict[str, bytes]:
    """Every object under `prefix` of the test bucket, as boto3 sees it: key -> bytes."""
    client = boto3.client("s3", endpoint_url=server["AWS_ENDPOINT_URL"],
                          aws_access_key_id=server["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=server["AWS_SECRET_ACCESS_KEY"],
                          region_name=server.get("AWS_REGION", "us-east-1"))
    out: Dict[str, bytes] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=server["TESSERA_TEST_BUCKET"], Prefix=prefix):
        for item in page.get("Contents", []):
            body = client.get_object(Bucket=server["TESSERA_TEST_BUCKET"], Key=item["Key"])
            out[item["Key"]] = body["Body"].read()
    return out


def full_state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(48, 20, generator=g), "b": torch.arange(20, dtype=torch.int64),
            "step": 3}


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("leading_slash", [False, True])
def test_a_checkpoint_tessera_saves_is_the_objects_msc_lists_and_reads(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch, fmt: str, leading_slash: bool) -> None:
    profile = unique_profile()
    prefix = f"msc-{profile}"
    base_path = ("/" if leading_slash else "") + f"{server['TESSERA_TEST_BUCKET']}/{prefix}"
    monkeypatch.setenv("MSC_CONFIG", write_config(str(tmp_path), fmt,
                                                  {profile: profile_config(server, base_path)}))
    full = full_state()
    url = f"msc://{profile}/run/iter_0000003"

    def save(comm: tessera.Comm) -> None:
        r = comm.rank
        tessera.save({"w": tessera.ShardedTensor(full["w"][24 * r:24 * r + 24].clone(), (48, 20),
                                                 (24 * r, 0)),
                      "b": full["b"], "step": full["step"]}, url, comm=comm)

    tessera.run_local(2, save)
    objects = s3_keys(server, prefix + "/")
    assert objects, f"nothing under {prefix}/ in the bucket"
    assert all(k.startswith(f"{prefix}/run/iter_0000003/") for k in objects), sorted(objects)
    # MSC lists the same objects under the same URL, and reads the same bytes. (With a leading
    # slash in base_path, MSC 1.3.1 names what it lists msc://profile/<bucket>/<prefix>/...: its
    # listing keeps the base path, though the objects are the same; compare the names below the
    # checkpoint.)
    names = sorted(k[len(prefix) + len("/run/iter_0000003/"):] for k in objects)
    listed = sorted(o.key.split("/run/iter_0000003/", 1)[1] for o in msc.list(url + "/"))
    assert listed == names
    for name in names:
        with msc.open(f"{url}/{name}", "rb") as f:
            assert f.read() == objects[f"{prefix}/run/iter_0000003/{name}"], name
    # And tessera reads it back, resharded (column bands on 4 ranks).
    def load(comm: tessera.Comm) -> None:
        r = comm.rank
        w = torch.zeros(48, 5)
        state = {"w": tessera.ShardedTensor(w, (48, 20), (0, 5 * r)),
                 "b": torch.zeros(20, dtype=torch.int64), "step": None}
        tessera.load(state, url, comm=comm)
        assert torch.equal(w, full["w"][:, 5 * r:5 * r + 5]) and state["step"] == 3

    tessera.run_local(4, load)


def test_a_dcp_checkpoint_written_through_msc_loads_with_tessera(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP with MSC's storage layer (multistorageclient.contrib.torch), one process."""
    import torch.distributed.checkpoint as dcp
    from multistorageclient.contrib.torch import MultiStorageFileSystemWriter

    profile = unique_profile()
    prefix = f"msc-{profile}"
    monkeypatch.setenv("MSC_CONFIG", write_config(str(tmp_path), "yaml", {
        profile: profile_config(server, f"{server['TESSERA_TEST_BUCKET']}/{prefix}")}))
    full = full_state()
    url = f"msc://{profile}/dcp/step_3"
    dcp.save({"w": full["w"], "b": full["b"]}, storage_writer=MultiStorageFileSystemWriter(url),
             checkpoint_id=url, no_dist=True)
    assert f"{prefix}/dcp/step_3/.metadata" in s3_keys(server, prefix + "/")
    assert tessera.read_metadata(url).format == "torch_dist"
    loaded = tessera.load_all(url, tensor_type="torch")
    assert torch.equal(loaded["w"], full["w"]) and torch.equal(loaded["b"], full["b"])

    def load(comm: tessera.Comm) -> None:
        r = comm.rank
        w = torch.zeros(16, 20)
        tessera.load({"w": tessera.ShardedTensor(w, (48, 20), (16 * r, 0))}, url, comm=comm,
                     strict=False)
        assert torch.equal(w, full["w"][16 * r:16 * r + 16])

    tessera.run_local(3, load)


def megatron_msc_worker(rank: int, size: int, port: int, url: str, config: str) -> None:
    """Megatron-Core's dist_checkpointing.save to an msc:// path with its MSC feature on."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.msc_utils import MultiStorageClientFeature

    from test_megatron_interop import megatron_cpu

    os.environ["MSC_CONFIG"] = config
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=120))
    try:
        MultiStorageClientFeature.enable()
        full = full_state()["w"]
        rows = full.shape[0] // size
        sharded = {"w": ShardedTensor.from_rank_offsets(
            "w", full[rank * rows:(rank + 1) * rows].clone(), (0, rank, size))}
        with megatron_cpu():
            dist_checkpointing.save(sharded, url)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_megatron_checkpoint_saved_to_msc_loads_with_tessera(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    profile = unique_profile()
    prefix = f"msc-{profile}"
    config = write_config(str(tmp_path), "yaml", {
        profile: profile_config(server, f"{server['TESSERA_TEST_BUCKET']}/{prefix}")})
    monkeypatch.setenv("MSC_CONFIG", config)
    url = f"msc://{profile}/megatron/iter_0000003"
    mp.start_processes(megatron_msc_worker, args=(2, free_port(), url, config), nprocs=2,
                       join=True, start_method="spawn")
    keys = s3_keys(server, prefix + "/")
    assert f"{prefix}/megatron/iter_0000003/metadata.json" in keys, sorted(keys)
    full = full_state()["w"]
    assert torch.equal(tessera.load_all(url, tensor_type="torch")["w"], full)

    def load(comm: tessera.Comm) -> None:
        r = comm.rank
        w = torch.zeros(48, 10)
        tessera.load({"w": tessera.ShardedTensor(w, (48, 20), (0, 10 * r))}, url, comm=comm,
                     strict=False)
        assert torch.equal(w, full[:, 10 * r:10 * r + 10])

    tessera.run_local(2, load)


def refused_by_msc(config: str, profile: str) -> str:
    """MSC's own error for `profile` of `config` (it must refuse it)."""
    from multistorageclient import StorageClient, StorageClientConfig
    with pytest.raises(Exception) as raised:
        StorageClient(StorageClientConfig.from_file(config_file_paths=[config], profile=profile))
    return str(raised.value)


def test_configs_msc_refuses_are_refused_by_name(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = server["TESSERA_TEST_BUCKET"]
    profile = unique_profile()
    monkeypatch.delenv("TESSERA_TEST_UNSET", raising=False)
    config = write_config(str(tmp_path), "yaml", {
        profile: profile_config(server, bucket + "/${TESSERA_TEST_UNSET}")})
    assert "Unresolved environment variables" in refused_by_msc(config, profile)
    monkeypatch.setenv("MSC_CONFIG", config)
    with pytest.raises(tessera.InvalidArgumentError) as raised:
        tessera.save({"x": torch.zeros(2)}, f"msc://{profile}/a")
    assert "unresolved environment variable ${TESSERA_TEST_UNSET}" in str(raised.value)
    assert config in str(raised.value)


def test_features_that_redirect_objects_are_refused_by_name(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas make MSC read from another profile's objects; tessera opens the primary's
    storage only, so it refuses the profile rather than read or write something else."""
    bucket = server["TESSERA_TEST_BUCKET"]
    primary, replica = unique_profile(), unique_profile()
    config = write_config(str(tmp_path), "yaml", {
        primary: profile_config(server, f"{bucket}/p",
                                replicas=[{"replica_profile": replica, "read_priority": 1}]),
        replica: profile_config(server, f"{bucket}/r")})
    monkeypatch.setenv("MSC_CONFIG", config)
    with pytest.raises(tessera.UnimplementedError) as raised:
        tessera.load_all(f"msc://{primary}/ck")
    assert "uses replicas" in str(raised.value) and primary in str(raised.value)


def test_pathlib_spelling_and_dot_segments(
        server: Dict[str, str], no_aws_environment: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """msc:/profile/path (pathlib collapses the slashes; MSC reads it as msc://) saves where
    msc:// does; a '..' segment, which MSC keeps in the key and tessera would resolve, is
    refused."""
    profile = unique_profile()
    prefix = f"msc-{profile}"
    monkeypatch.setenv("MSC_CONFIG", write_config(str(tmp_path), "json", {
        profile: profile_config(server, f"{server['TESSERA_TEST_BUCKET']}/{prefix}")}))
    tessera.save({"x": torch.arange(4)}, f"msc:/{profile}/single")
    assert torch.equal(tessera.load_all(f"msc://{profile}/single", tensor_type="torch")["x"],
                       torch.arange(4))
    names: List[str] = [o.key for o in msc.list(f"msc://{profile}/single/")]
    assert names, "MSC lists nothing where tessera saved"
    with pytest.raises(tessera.InvalidArgumentError, match=r"'\.\.' segment"):
        tessera.save({"x": torch.arange(4)}, f"msc://{profile}/a/../b")
