"""An S3 server (moto's own, in this process) and the suite's S3 client (boto3) for vllm-obj.

Runs in the s3-moto environment; standard JSON-lines driver protocol (jsonl_loop.py). The
server lives as long as this process: `down` is the driver's close. KVCONFORM_S3_PORT is the
port, KVCONFORM_S3_BUCKET the bucket it creates before it says ready. moto checks request
signatures, so every read and write here is signed as vLLM's are (any key pair)."""

from __future__ import annotations

import importlib.metadata
import os

import boto3
from jsonl_loop import serve
from moto.server import ThreadedMotoServer

PORT = int(os.environ["KVCONFORM_S3_PORT"])
BUCKET = os.environ["KVCONFORM_S3_BUCKET"]
ACCESS_KEY, SECRET_KEY, REGION = "kvconform", "kvconform-secret", "us-east-1"

server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
server.start()
client = boto3.client(
    "s3",
    endpoint_url=f"http://127.0.0.1:{PORT}",
    aws_access_key_id=ACCESS_KEY,
    aws_secret_access_key=SECRET_KEY,
    region_name=REGION,
)
client.create_bucket(Bucket=BUCKET)


def listing(prefix: str = "") -> dict[str, int]:
    sizes: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            sizes[item["Key"]] = int(item["Size"])
    return sizes


def read(key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def write(key: str, data_hex: str) -> None:
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes.fromhex(data_hex))


def wipe() -> int:
    keys = list(listing())
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": batch})
    return len(keys)


serve(
    "s3-moto",
    f"moto {importlib.metadata.version('moto')}",
    {"listing": listing, "read": read, "write": write, "wipe": wipe},
)
server.stop()
