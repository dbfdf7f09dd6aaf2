"""Whole-checkpoint S3 benchmark: tessera against what users run to checkpoint to S3, on moto
with request signing enforced, every byte and request counted by a proxy.

    scripts/bench-s3 [--size 256MiB] [--procs 2] [--rounds 3]
                     [--systems tessera,dcp_s3torchconnector,dcp_msc,raw]
                     [--phases save,load,reshard_load] [--json PATH]

The systems (each saves and loads through s3:// or msc:// URIs as its users do):
  tessera               tessera.save / tessera.load (harness_systems.Tessera, its own format) on
                        s3://bucket/prefix; endpoint, region and keys from AWS_* variables.
  dcp_s3torchconnector  torch.distributed.checkpoint save/load with s3torchconnector's
                        S3StorageWriter / S3StorageReader (S3ClientConfig(force_path_style=True);
                        the writer and reader take no endpoint argument: the native client reads
                        AWS_ENDPOINT_URL), defaults otherwise. Its DCP module needs the
                        distribution's "dcp" extra (tenacity); without it the system is listed
                        with that reason.
  dcp_msc               DCP with multistorageclient.contrib.torch's MultiStorageFileSystemWriter
                        / Reader on msc://bench/..., a profile of type s3 (base_path bucket/run,
                        endpoint_url, region_name, s3.addressing_style path, S3Credentials) in an
                        MSC config this harness writes (MSC_CONFIG), defaults otherwise.
  raw                   the baseline: each rank uploads the bytes of its local shards (and the
                        small objects) back to back as one object with boto3's transfer manager
                        (upload_fileobj, TransferConfig of 8 MiB parts and threshold, 8 in
                        flight) and downloads them into the same memory (download_fileobj); no
                        metadata, no resharding.

The state is harness_state.py's (the Megatron-style BF16 parameters with F32 Adam moments and a
small object, DTensors placed Shard(0) on a 1-D CPU DeviceMesh of --procs gloo processes started
with torch.multiprocessing's spawn). Phases: save; load into the same layout; reshard_load into
the other layout (Shard(1) columns, Replicate for 1-D tensors).

The server: build/tessera_moto_server (moto on loopback, SigV4 checked against an IAM user's
keys, a bucket made), and in front of it a counting proxy (s3_proxy.py, threads in this
harness's own process) that every client of every system uses as its endpoint. moto answers
every request with "Connection: close", so each request of every client is a new connection.

Method. Each round runs every system once, the order rotated by one system per round; a
system's block is: save into a fresh prefix, load, reshard_load, then (untimed) delete the
prefix directly on moto. A phase is timed on rank 0 from a barrier before it to a barrier after
it; rank 0 reads the proxy's counters before the first barrier and after the second, and a third
barrier keeps every rank from the next request until it has. In the first round each load's
targets are zeroed first and checked bit for bit after (harness_state.BenchState.check).

Numbers, per system and phase (state bytes: every element of the state once, plus the object;
GB = 1e9 bytes):
  best_seconds, median_seconds  over the rounds
  gb_per_s_best, gb_per_s_median  state bytes / seconds
  requests_per_gb         HTTP requests through the proxy in the phase / state GB (median of
                          the rounds; requests by method per round in the JSON)
  server_bytes_per_state_byte  saves: body bytes the server received (request bodies, chunk
                          framing included); loads: body bytes the server sent (response
                          bodies); over the state bytes, which every phase needs whole
  mean_server_bytes_per_request  the bytes above over the requests (medians): how much each
                          request moves
  cpu_seconds_per_gb      getrusage(RUSAGE_SELF) user + system seconds of each rank from after
                          the barrier before the phase to the return of the system's call,
                          summed over the ranks, per state GB (median of the rounds): the client
                          processes only (the proxy and moto are other processes)
and the load average at the start and at the end of the run.

Caveat. moto is one Python process on the same machine; it hashes, copies and stores every byte,
so it bounds every client's time and the seconds and GB/s say more about moto than about the
clients. What carries over to a real bucket are the client's own properties: requests per GB,
bytes the server moved per byte of the state, and client CPU per GB. moto also serves a ranged
GET by reading the whole object and slicing it (moto/s3/responses.py, key_response and
_handle_range_header), so on moto a GET costs time in proportion to the size of the object, not
of the range: a client that reads a large object in many small ranges is slowed far more on
moto than it would be on S3.

Output: one JSON object on stdout (and in --json PATH), a markdown table on stderr. Any error of
any system stops the run with a nonzero exit status and the error; a system or phase that cannot
run here is listed with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import io
import json
import logging
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from typing import Any, Callable, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import machine, versions  # noqa: E402
from harness_state import BenchState, Layout, build_state, local_of, parse_size  # noqa: E402
from harness_systems import System, Tessera, buffer_of, version_of  # noqa: E402
from s3_proxy import CountingProxy, difference, fetch_counters  # noqa: E402

ALL_SYSTEMS = ("tessera", "dcp_s3torchconnector", "dcp_msc", "raw")
ALL_PHASES = ("save", "load", "reshard_load")
LOAD_LAYOUTS: dict[str, Layout] = {"load": "load", "reshard_load": "reshard"}
MSC_PROFILE = "bench"
PART_BYTES = 8 << 20
RAW_CONCURRENCY = 8
GB = 1e9
PACKAGES = ("torch", "tessera", "boto3", "botocore", "moto", "s3torchconnector",
            "s3torchconnectorclient", "multi-storage-client", "werkzeug")
AWS_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
               "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_DEFAULT_REGION")


# ---- the systems ---------------------------------------------------------------------------------

class S3System(System):
    """A system of this benchmark: the harness_systems.System interface, plus where a block's
    checkpoint lives for it."""

    def __init__(self) -> None:
        super().__init__(False)  # no --sync here: an S3 object is durable once written

    def uri(self, bucket: str, run_id: str, relative: str) -> str:
        """The URI the system saves to and loads from for key prefix `run_id/relative`."""
        return f"s3://{bucket}/{run_id}/{relative}"


class TesseraS3(S3System):
    """tessera.save / tessera.load on s3:// URIs: harness_systems.Tessera's calls."""

    name = "tessera"
    role = "tessera"
    module = "tessera"

    def __init__(self) -> None:
        super().__init__()
        self._inner = Tessera(False, "tessera")

    def config(self) -> dict[str, Any]:
        return {**self._inner.config(),
                "sync": "False (S3 objects are durable once written; no fsync applies)",
                "uri": "s3://<bucket>/<run>/r<round>-tessera/ckpt",
                "s3": "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL "
                      "(the proxy); addressing auto (path-style on a custom endpoint); "
                      "client defaults otherwise"}

    def save(self, state: BenchState, path: str) -> None:
        self._inner.save(state, path)
        self.last_save_breakdown = self._inner.last_save_breakdown

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        return self._inner.load(state, path, layout)


class DcpS3Connector(S3System):
    """DCP with s3torchconnector's S3StorageWriter / S3StorageReader."""

    name = "dcp_s3torchconnector"
    module = "s3torchconnector.dcp"

    def _client_config(self) -> Any:
        from s3torchconnector import S3ClientConfig
        return S3ClientConfig(force_path_style=True)

    def unavailable(self) -> Optional[str]:
        try:
            importlib.import_module(self.module or "")
        except ModuleNotFoundError as e:
            # s3torchconnector's DCP classes need the distribution's "dcp" extra; name the
            # requirement from its own METADATA when that is what is missing.
            extra = [r for r in (importlib.metadata.requires("s3torchconnector") or [])
                     if 'extra == "dcp"' in r]
            missing = [r.split(";")[0].strip() for r in extra
                       if e.name and r.split(";")[0].strip().lower().startswith(e.name.lower())]
            if missing:
                version = version_of("s3torchconnector")
                return (f"import {self.module} failed: No module named '{e.name}': "
                        f"s3torchconnector {version} is installed without its 'dcp' extra "
                        f"(its METADATA: Requires-Dist: {missing[0]}; extra == \"dcp\"; "
                        f"s3torchconnector/dcp/s3_file_system.py imports it); install "
                        f"'s3torchconnector[dcp]=={version}' to run this system")
            return f"import {self.module} failed: ModuleNotFoundError: {e}"
        except Exception as e:
            return f"import {self.module} failed: {type(e).__name__}: {e}"
        if not os.environ.get("AWS_ENDPOINT_URL"):
            return "AWS_ENDPOINT_URL is not set (the harness sets it to the proxy)"
        return None

    def config(self) -> dict[str, Any]:
        return {"s3torchconnector": version_of("s3torchconnector"), "torch": torch.__version__,
                "writer": "S3StorageWriter(region, uri, s3client_config=S3ClientConfig("
                          "force_path_style=True)) (thread_count=1, sync_files=False: its "
                          "defaults)",
                "reader": "S3StorageReader(region, uri, s3client_config=S3ClientConfig("
                          "force_path_style=True)) (reader_constructor: its default, "
                          "S3ReaderConstructor.dcp_optimized())",
                "client_defaults": "part_size 8 MiB, throughput_target_gbps 10, max_attempts 10",
                "endpoint": "AWS_ENDPOINT_URL (the proxy), read by the native client",
                "planner": "DCP's default", "uri": "s3://<bucket>/<run>/r<round>-"
                                                   "dcp_s3torchconnector/ckpt"}

    def notes(self) -> list[str]:
        return ["S3StorageWriter and S3StorageReader 1.5.0 take no endpoint argument "
                "(S3FileSystem builds S3Client(region, user_agent, s3client_config) without "
                "one); the native MountpointS3Client reads AWS_ENDPOINT_URL, and the harness "
                "checks that every phase's requests went through the proxy"]

    def save(self, state: BenchState, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter
        writer = S3StorageWriter(os.environ["AWS_REGION"], path,
                                 s3client_config=self._client_config())
        dcp.save(state.flat("save"), storage_writer=writer)

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader
        flat = state.flat(layout)
        reader = S3StorageReader(os.environ["AWS_REGION"], path,
                                 s3client_config=self._client_config())
        dcp.load(flat, storage_reader=reader)
        return flat


class DcpMsc(S3System):
    """DCP with multi-storage-client's MultiStorageFileSystemWriter / Reader on msc:// URIs."""

    name = "dcp_msc"
    module = "multistorageclient.contrib.torch"

    def unavailable(self) -> Optional[str]:
        reason = super().unavailable()
        if reason is None and not os.environ.get("MSC_CONFIG"):
            return "MSC_CONFIG is not set (the harness writes the config and sets it)"
        return reason

    def uri(self, bucket: str, run_id: str, relative: str) -> str:
        return f"msc://{MSC_PROFILE}/{relative}"  # base_path is <bucket>/<run_id>

    def config(self) -> dict[str, Any]:
        return {"multi-storage-client": version_of("multi-storage-client"),
                "torch": torch.__version__,
                "writer": "MultiStorageFileSystemWriter(uri) (its defaults: "
                          "single_file_per_rank=True, sync_files=True, thread_count=1)",
                "reader": "MultiStorageFileSystemReader(uri) (thread_count=1)",
                "msc_config": {"profiles": {MSC_PROFILE: {
                    "storage_provider": {"type": "s3", "options": {
                        "base_path": "<bucket>/<run>", "endpoint_url": "<the proxy>",
                        "region_name": "us-east-1", "s3": {"addressing_style": "path"}}},
                    "credentials_provider": {"type": "S3Credentials", "options": {
                        "access_key": "<moto IAM user>", "secret_key": "<moto IAM user>"}}}}},
                "planner": "DCP's default", "uri": f"msc://{MSC_PROFILE}/r<round>-dcp_msc/ckpt"}

    def notes(self) -> list[str]:
        return ["MSC's S3 provider is boto3 (its own TransferConfig defaults); a write goes to a "
                "local buffer uploaded at close, a read downloads the whole object first "
                "(MultiStorageFileSystem.create_stream opens with prefetch_file=True)"]

    def save(self, state: BenchState, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from multistorageclient.contrib.torch import MultiStorageFileSystemWriter
        dcp.save(state.flat("save"), storage_writer=MultiStorageFileSystemWriter(path))

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from multistorageclient.contrib.torch import MultiStorageFileSystemReader
        flat = state.flat(layout)
        dcp.load(flat, storage_reader=MultiStorageFileSystemReader(path))
        return flat


class _Pieces(io.RawIOBase):
    """A seekable, readable and writable file over memoryviews back to back (a rank's shards
    and objects), so that boto3 reads the upload from, and writes the download into, the
    tensors' own memory."""

    def __init__(self, pieces: list[memoryview]) -> None:
        super().__init__()
        self._pieces = pieces
        self._starts: list[int] = []
        total = 0
        for piece in pieces:
            self._starts.append(total)
            total += len(piece)
        self._size, self._pos = total, 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def _spans(self, n: int) -> Iterator[tuple[memoryview, int, int]]:
        """(piece, offset in piece, length) covering [pos, pos + n) clipped to the size."""
        pos, end = self._pos, min(self._pos + n, self._size)
        index = 0
        while index + 1 < len(self._starts) and self._starts[index + 1] <= pos:
            index += 1
        while pos < end:
            piece, start = self._pieces[index], self._starts[index]
            length = min(end - pos, start + len(piece) - pos)
            if length > 0:
                yield piece, pos - start, length
                pos += length
            index += 1

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        for piece, offset, length in self._spans(len(out)):
            out[done:done + length] = piece[offset:offset + length]
            done += length
        self._pos += done
        return done

    def write(self, data: Any) -> int:
        source = memoryview(data).cast("B")
        if self._pos + len(source) > self._size:
            raise ValueError(f"a write of {len(source)} bytes at {self._pos} passes the end "
                             f"({self._size})")
        done = 0
        for piece, offset, length in self._spans(len(source)):
            piece[offset:offset + length] = source[done:done + length]
            done += length
        self._pos += done
        return done


class RawBoto3(S3System):
    """The baseline: one object per rank with boto3's transfer manager (module docstring)."""

    name = "raw"
    role = "baseline"
    module = "boto3.s3.transfer"

    def __init__(self) -> None:
        super().__init__()
        self._client: Any = None
        self._transfer: Any = None

    def _ready(self) -> None:
        """The client and TransferConfig (made once, outside any timing, as a trainer keeps
        them)."""
        if self._client is None:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
            self._client = boto3.client(
                "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                region_name=os.environ["AWS_REGION"],
                config=Config(s3={"addressing_style": "path"},
                              max_pool_connections=RAW_CONCURRENCY))
            self._transfer = TransferConfig(multipart_threshold=PART_BYTES,
                                            multipart_chunksize=PART_BYTES,
                                            max_concurrency=RAW_CONCURRENCY)

    def config(self) -> dict[str, Any]:
        return {"boto3": version_of("boto3"), "botocore": version_of("botocore"),
                "objects": "one per rank: <prefix>/rank<r>.bin, the rank's local shards and "
                           "the objects back to back",
                "save": "upload_fileobj(file over the tensors' memory, TransferConfig("
                        f"multipart_threshold={PART_BYTES}, multipart_chunksize={PART_BYTES}, "
                        f"max_concurrency={RAW_CONCURRENCY}))",
                "load": "download_fileobj into a file over the targets' memory, same "
                        "TransferConfig",
                "client": "boto3.client('s3', endpoint_url=<proxy>, path addressing, "
                          f"max_pool_connections={RAW_CONCURRENCY}), made once outside the "
                          "timing; botocore's default checksums"}

    def notes(self) -> list[str]:
        return ["the baseline: no metadata, no checksums of its own, no commit protocol, no "
                "resharding"]

    def prepare(self, phase: str, state: BenchState, variant: Optional[str] = None) -> None:
        self._ready()

    def _key(self, path: str) -> tuple[str, str]:
        bucket, _, prefix = path[len("s3://"):].partition("/")
        return bucket, f"{prefix}/rank{self.rank}.bin"

    def save(self, state: BenchState, path: str) -> None:
        pieces = [buffer_of(local_of(leaf.saved)) for leaf in state.leaves]
        pieces += [memoryview(value) for value in state.objects.values()]
        bucket, key = self._key(path)
        self._client.upload_fileobj(_Pieces(pieces), bucket, key, Config=self._transfer)

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        assert layout == "load"
        loaded = state.flat(layout)
        pieces = [buffer_of(local_of(leaf.target(layout))) for leaf in state.leaves]
        objects = {key: bytearray(len(value)) for key, value in state.objects.items()}
        pieces += [memoryview(buffer) for buffer in objects.values()]
        bucket, key = self._key(path)
        self._client.download_fileobj(bucket, key, _Pieces(pieces), Config=self._transfer)
        for name, buffer in objects.items():
            loaded[name] = bytes(buffer)
        return loaded

    def reshard_unavailable(self) -> Optional[str]:
        return "the baseline writes and reads each rank's own bytes; it has no resharding"


SYSTEMS: dict[str, Callable[[], S3System]] = {
    "tessera": TesseraS3, "dcp_s3torchconnector": DcpS3Connector, "dcp_msc": DcpMsc,
    "raw": RawBoto3}


# ---- one rank ----------------------------------------------------------------------------------

def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def delete_prefix(endpoint: str, bucket: str, prefix: str) -> int:
    """Deletes every object and multipart upload under `prefix` (directly on moto, not through
    the proxy); returns the number of objects deleted."""
    import boto3
    from botocore.config import Config
    client = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ["AWS_REGION"],
                          config=Config(s3={"addressing_style": "path"}))
    deleted = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            reply = client.delete_objects(Bucket=bucket,
                                          Delete={"Objects": keys[i:i + 1000], "Quiet": True})
            if reply.get("Errors"):
                raise RuntimeError(f"deleting s3://{bucket}/{prefix}: {reply['Errors'][:3]}")
            deleted += len(keys[i:i + 1000])
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    for upload in uploads:
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                      UploadId=upload["UploadId"])
    return deleted


class S3Rank:
    """What one rank does: the rounds of blocks, timed and counted; results gathered to 0."""

    def __init__(self, cfg: dict[str, Any], state: BenchState, systems: list[S3System]) -> None:
        self.cfg, self.state, self.systems = cfg, state, systems
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.results: dict[str, Any] = {}

    def measured(self, system: S3System, phase: str,
                 fn: Callable[[], Any]) -> dict[str, Any]:
        """Runs fn() as one timed phase (module docstring): seconds on rank 0, the proxy's
        counts of the phase, and every rank's CPU seconds."""
        before = fetch_counters(self.cfg["control_url"]) if self.rank == 0 else None
        dist.barrier()
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        fn()
        cpu = cpu_seconds() - cpu_start
        dist.barrier()
        seconds = time.perf_counter() - start
        counts = None
        if self.rank == 0:
            assert before is not None
            counts = difference(fetch_counters(self.cfg["control_url"]), before)
            if sum(counts["requests"].values()) == 0:
                raise RuntimeError(f"{system.name} {phase}: no request went through the "
                                   "proxy (the system did not use the endpoint it was given)")
        dist.barrier()
        cpus: list[Any] = [None] * self.world
        dist.all_gather_object(cpus, cpu)
        return {"seconds": seconds, "counts": counts, "cpu_seconds_per_rank": cpus}

    def block(self, system: S3System, round_index: int) -> None:
        """One system's phases in one round, then its prefix deleted."""
        r = self.results[system.name]["phases"]
        phases, check = self.cfg["phases"], round_index == 0
        relative = f"r{round_index}-{system.name}/ckpt"
        uri = system.uri(self.cfg["bucket"], self.cfg["run_id"], relative)
        system.prepare("save", self.state)
        sample = self.measured(system, "save", lambda: system.save(self.state, uri))
        system.finish("save")
        if "save" in phases:
            r["save"]["samples"].append(sample)
        for phase, layout in LOAD_LAYOUTS.items():
            if phase not in phases or r[phase].get("reason"):
                continue
            if check:
                self.state.zero(layout)
            loaded: list[dict[str, Any]] = []
            system.prepare(phase, self.state)
            sample = self.measured(system, phase, lambda: loaded.append(
                system.load(self.state, uri, layout)))
            system.finish(phase)
            r[phase]["samples"].append(sample)
            if check:
                self.state.check(loaded[0], layout, system.name)
                r[phase]["verified"] = True
        system.end_block()
        dist.barrier()
        if self.rank == 0:
            prefix = f"{self.cfg['run_id']}/r{round_index}-{system.name}/"
            if delete_prefix(self.cfg["moto_url"], self.cfg["bucket"], prefix) == 0:
                raise RuntimeError(f"{system.name}: nothing was stored under "
                                   f"s3://{self.cfg['bucket']}/{prefix}")
        dist.barrier()

    def run(self) -> Optional[dict[str, Any]]:
        """Every round; returns the result on rank 0 (None elsewhere)."""
        available = []
        for system in self.systems:
            reasons: list[Any] = [None] * self.world
            dist.all_gather_object(reasons, system.unavailable())
            reason = next((x for x in reasons if x), None)
            entry: dict[str, Any] = {"role": system.role, "reason": reason, "config": {},
                                     "notes": []}
            self.results[system.name] = entry
            if reason is not None:
                continue
            available.append(system)
            entry.update(config=system.config(), notes=system.notes())
            reshard = system.reshard_unavailable()
            phases: dict[str, Any] = {"save": {"samples": []},
                                      "load": {"samples": [], "verified": False},
                                      "reshard_load": ({"reason": reshard} if reshard else
                                                       {"samples": [], "verified": False})}
            entry["phases"] = {k: v for k, v in phases.items() if k in self.cfg["phases"]}
            entry["phases"].setdefault("save", {"samples": []})  # saved even if not reported
        order = []
        for round_index in range(self.cfg["rounds"]):
            shift = round_index % max(1, len(available))
            names = []
            for system in available[shift:] + available[:shift]:
                try:
                    self.block(system, round_index)
                except BaseException:
                    with open(os.path.join(self.cfg["run_dir"], f"error-{self.rank}.txt"),
                              "w") as f:
                        f.write(f"rank {self.rank}: {system.name}, round {round_index}:\n"
                                f"{traceback.format_exc()}")
                    raise
                names.append(system.name)
            order.append(names)
        for system in available:
            phases = self.results[system.name]["phases"]
            if "save" not in self.cfg["phases"]:
                phases.pop("save", None)
        sizes: list[Any] = [None] * self.world
        dist.all_gather_object(sizes, self.state.local_bytes())
        if self.rank != 0:
            return None
        return {"systems": self.results, "order": order, "state": self.state.description,
                "state_bytes": self.state.global_bytes(), "bytes_per_rank": sizes,
                "torch_num_threads": torch.get_num_threads()}


def run_rank(rank: int, cfg: dict[str, Any]) -> None:
    """The body of each process (torch.multiprocessing's entry point)."""
    world = cfg["procs"]
    if not cfg["verbose"]:
        warnings.simplefilter("ignore")
        for name in ("s3torchconnector", "multistorageclient", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(cfg["run_dir"], "store"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    state = build_state("megatron", cfg["size"], mesh)
    systems = [SYSTEMS[name]() for name in cfg["systems"]]
    try:
        result = S3Rank(cfg, state, systems).run()
    finally:
        for system in systems:
            system.close()
    if result is not None:
        with open(os.path.join(cfg["run_dir"], "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(cfg["run_dir"], f"done-{rank}"), "w"):
        pass


# ---- the server and the job ----------------------------------------------------------------------

@contextlib.contextmanager
def moto_server(run_dir: str) -> Iterator[dict[str, str]]:
    """build/tessera_moto_server in `run_dir`: yields the variables it writes (AWS_*,
    TESSERA_TEST_BUCKET); stops it after. Raises when it cannot start."""
    program = os.path.join(ROOT, "build", "tessera_moto_server")
    if not os.access(program, os.X_OK):
        raise RuntimeError(f"{program} is missing: build the target tessera_moto_server "
                           "(scripts/build)")
    env_file = os.path.join(run_dir, "moto.env")
    log_path = os.path.join(run_dir, "moto.log")
    with open(log_path, "w+") as log:
        server = subprocess.Popen([program, env_file], stderr=log, cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while (not os.path.exists(env_file) and server.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            if not os.path.exists(env_file):
                log.seek(0)
                raise RuntimeError(f"the S3 server (moto) did not start: {log.read()}")
            with open(env_file) as f:
                yield dict(line.split("=", 1) for line in f.read().splitlines() if line)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def client_environment(server: dict[str, str], proxy_url: str, msc_config: str) -> None:
    """Sets this process's environment (inherited by the ranks) as a user of the server sets
    it, with the proxy as the endpoint; nothing from ~/.aws."""
    for name in AWS_CLEARED:
        os.environ.pop(name, None)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        os.environ[name] = server[name]
    os.environ["AWS_ENDPOINT_URL"] = proxy_url
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["MSC_CONFIG"] = msc_config


def write_msc_config(run_dir: str, server: dict[str, str], proxy_url: str, run_id: str) -> str:
    """The MSC config of the dcp_msc system (JSON); returns its path."""
    config = {"profiles": {MSC_PROFILE: {
        "storage_provider": {"type": "s3", "options": {
            "base_path": f"{server['TESSERA_TEST_BUCKET']}/{run_id}",
            "endpoint_url": proxy_url, "region_name": server["AWS_REGION"],
            "s3": {"addressing_style": "path"}}},
        "credentials_provider": {"type": "S3Credentials", "options": {
            "access_key": server["AWS_ACCESS_KEY_ID"],
            "secret_key": server["AWS_SECRET_ACCESS_KEY"]}}}}}
    path = os.path.join(run_dir, "msc_config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def launch(cfg: dict[str, Any]) -> Optional[str]:
    """Runs the ranks; returns None, or why the job failed (each failed rank's error)."""
    import torch.multiprocessing as mp
    failure = None
    try:
        mp.start_processes(run_rank, args=(cfg,), nprocs=cfg["procs"], join=True,
                           start_method="spawn")
    except Exception as e:  # ProcessRaisedException, ProcessExitedException
        failure = f"{type(e).__name__}: {e}".strip()
    errors = []
    for name in sorted(os.listdir(cfg["run_dir"])):
        if name.startswith("error-"):
            with open(os.path.join(cfg["run_dir"], name)) as f:
                errors.append(f.read())
    if failure is None and not all(os.path.exists(os.path.join(cfg["run_dir"], f"done-{r}"))
                                   for r in range(cfg["procs"])):
        failure = "a rank did not finish its work"
    if failure is None:
        return None
    return "\n".join(errors) if errors else failure


# ---- the report --------------------------------------------------------------------------------

def summarize_phase(phase: str, samples: list[dict[str, Any]], state_bytes: int
                    ) -> dict[str, Any]:
    """The numbers of one system's phase from its samples (one per round)."""
    gb = state_bytes / GB
    seconds = [s["seconds"] for s in samples]
    counted = "request_body_bytes" if phase == "save" else "response_body_bytes"
    requests = [sum(s["counts"]["requests"].values()) for s in samples]
    moved = [s["counts"][counted] for s in samples]
    cpus = [sum(s["cpu_seconds_per_rank"]) for s in samples]
    best, median = min(seconds), statistics.median(seconds)
    return {
        "samples_seconds": seconds, "best_seconds": best, "median_seconds": median,
        "gb_per_s_best": gb / best, "gb_per_s_median": gb / median,
        "requests_per_gb": statistics.median(requests) / gb,
        "server_bytes_per_state_byte": statistics.median(moved) / state_bytes,
        "server_bytes_counted": ("body bytes the server received" if phase == "save"
                                 else "body bytes the server sent"),
        "cpu_seconds_per_gb": statistics.median(cpus) / gb,
        "mean_server_bytes_per_request": (statistics.median(moved) /
                                          statistics.median(requests)),
        "per_round": [{"seconds": s["seconds"], "requests": s["counts"]["requests"],
                       "statuses": s["counts"]["statuses"],
                       "request_body_bytes": s["counts"]["request_body_bytes"],
                       "response_body_bytes": s["counts"]["response_body_bytes"],
                       "connections": s["counts"]["connections"],
                       "client_aborts": s["counts"]["client_aborts"],
                       "cpu_seconds_per_rank": s["cpu_seconds_per_rank"]} for s in samples]}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The "systems" part of the output."""
    out: dict[str, Any] = {}
    for name, r in result["systems"].items():
        entry: dict[str, Any] = {"available": r["reason"] is None, "reason": r["reason"],
                                 "role": r["role"], "config": r["config"], "notes": r["notes"]}
        if r["reason"] is None:
            entry["phases"] = {}
            for phase in ALL_PHASES:
                p = r["phases"].get(phase)
                if p is None:
                    continue
                if p.get("reason"):
                    entry["phases"][phase] = {"reason": p["reason"]}
                    continue
                entry["phases"][phase] = {**summarize_phase(phase, p["samples"],
                                                            result["state_bytes"]),
                                          **({"verified": p["verified"]} if "verified" in p
                                             else {})}
        out[name] = entry
    return out


def method_text(requests: dict[str, int]) -> str:
    """'PUT 40, POST 4' of a requests-by-method dict."""
    return ", ".join(f"{m} {n}" for m, n in sorted(requests.items(), key=lambda x: -x[1]))


def table(output: dict[str, Any]) -> str:
    """The markdown table of the output."""
    c = output["config"]
    lines = [f"S3 on moto through a counting proxy: {c['state_bytes'] / (1 << 20):.1f} MiB "
             f"state, {c['procs']} ranks, {c['rounds']} rounds; load average "
             f"{output['load_average']['start']} -> {output['load_average']['end']}", "",
             "| system | phase | best s | median s | GB/s (best) | requests/GB | server bytes "
             "/ state byte | client CPU s/GB | requests (round 1) | verified |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in output["systems"].items():
        if not s["available"]:
            lines.append(f"| {name} | - | cannot run: {s['reason']} | | | | | | | |")
            continue
        for phase, p in s["phases"].items():
            if p.get("reason"):
                lines.append(f"| {name} | {phase} | n/a: {p['reason']} | | | | | | | |")
                continue
            verified = {True: "yes", False: "NO"}.get(p.get("verified"), "-")
            lines.append(
                f"| {name} | {phase} | {p['best_seconds']:.2f} | {p['median_seconds']:.2f} | "
                f"{p['gb_per_s_best']:.3f} | {p['requests_per_gb']:.0f} | "
                f"{p['server_bytes_per_state_byte']:.4f} | {p['cpu_seconds_per_gb']:.2f} | "
                f"{method_text(p['per_round'][0]['requests'])} | {verified} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="state size (256MiB by default)")
    ap.add_argument("--procs", type=int, default=2, choices=(2, 4, 8),
                    help="processes (ranks), 2 by default")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (3 by default)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--phases", default=",".join(ALL_PHASES),
                    help=f"comma-separated subset of {','.join(ALL_PHASES)}")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON to PATH")
    ap.add_argument("--timeout", type=int, default=1800, help="gloo timeout in seconds")
    ap.add_argument("--verbose", action="store_true",
                    help="keep the systems' Python warnings and log messages")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    phases = [p for p in args.phases.split(",") if p]
    unknown = ([s for s in systems if s not in ALL_SYSTEMS] +
               [p for p in phases if p not in ALL_PHASES])
    if unknown:
        ap.error(f"unknown system or phase: {', '.join(unknown)}")
    if not systems or not phases:
        ap.error("--systems and --phases need at least one name each")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        args.size_bytes = parse_size(args.size)
    except ValueError as e:
        ap.error(str(e))
    args.systems = [s for s in ALL_SYSTEMS if s in systems]
    args.phases = [p for p in ALL_PHASES if p in phases]
    return args


def main(argv: list[str]) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    begin = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="tessera-s3-bench-")
    run_id = f"bench-s3-{uuid.uuid4().hex[:12]}"
    proxy: Optional[CountingProxy] = None
    try:
        with moto_server(run_dir) as server:
            host, _, port = server["AWS_ENDPOINT_URL"].split("://", 1)[1].rstrip("/") \
                .partition(":")
            proxy = CountingProxy(host, int(port)).start()
            msc_config = write_msc_config(run_dir, server, proxy.url, run_id)
            client_environment(server, proxy.url, msc_config)
            cfg = {"size": args.size_bytes, "procs": args.procs, "rounds": args.rounds,
                   "systems": args.systems, "phases": args.phases, "run_dir": run_dir,
                   "run_id": run_id, "bucket": server["TESSERA_TEST_BUCKET"],
                   "moto_url": server["AWS_ENDPOINT_URL"], "control_url": proxy.control_url,
                   "timeout": args.timeout, "verbose": args.verbose}
            failure = launch(cfg)
            if failure is None and proxy.errors:
                failure = "the proxy met server-side errors:\n" + "\n".join(proxy.errors)
            if failure is not None:
                print(f"bench-s3: the run failed:\n{failure}", file=sys.stderr)
                return 1
            with open(os.path.join(run_dir, "result.json")) as f:
                result = json.load(f)
            proxy_total = proxy.snapshot()
    except RuntimeError as e:
        print(f"bench-s3: {e}", file=sys.stderr)
        return 1
    finally:
        if proxy is not None:
            proxy.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    load_end = [round(x, 2) for x in os.getloadavg()]
    found = versions()  # harness.py's: the python, tessera's location, the commit
    package_versions = {k: found.get(k) for k in ("python", "tessera_location",
                                                  "repository_commit")}
    package_versions.update({name: version_of(name) for name in PACKAGES})
    output: dict[str, Any] = {
        "harness": "bench/peers/s3_harness.py",
        "command": shlex.join(["scripts/bench-s3"] + argv),
        "date": started, "wall_seconds": round(time.perf_counter() - begin, 1),
        "machine": machine(tempfile.gettempdir()), "versions": package_versions,
        "load_average": {"start": load_start, "end": load_end},
        "server": {"program": "build/tessera_moto_server", "moto": version_of("moto"),
                   "signing": "enforced: SigV4 against an IAM user's access key",
                   "proxy": "bench/peers/s3_proxy.py, threads in the harness's process, on "
                            "127.0.0.1; every system's endpoint",
                   "keep_alive": "moto replies Connection: close to every request (each "
                                 "request is a new connection)",
                   "ranged_get": "moto reads the whole object for each ranged GET and slices "
                                 "it: a GET's cost on moto grows with the object's size",
                   "proxy_totals": proxy_total},
        "config": {"state": "megatron", "size_requested": args.size, "size_bytes": args.size_bytes,
                   "state_bytes": result["state_bytes"], "bytes_per_rank": result["bytes_per_rank"],
                   "procs": args.procs, "rounds": args.rounds, "phases": args.phases,
                   "torch_num_threads": result["torch_num_threads"], "gb": "1e9 bytes",
                   "placement": "save Shard(0); load Shard(0); reshard_load Shard(1) (Replicate "
                                "for 1-D tensors); 1-D CPU DeviceMesh, gloo"},
        "state": result["state"], "order": result["order"],
        "systems": summarize(result),
    }
    text = json.dumps(output, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    print(table(output), end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
