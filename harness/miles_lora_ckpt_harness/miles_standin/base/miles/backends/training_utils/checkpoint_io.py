"""Stand-in of miles/backends/training_utils/checkpoint_io.py: staging, version directory, symlink.

Rank 0 clears and creates `<parent>/_tmp_<name>`; every rank writes; a barrier; rank 0 renames the
staging directory to `<parent>/_version_<name>_<uuid4>` and swaps the relative symlink `<name>`
onto it. An existing real directory `<name>` raises NotImplementedError on rank 0 only.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist


def write_checkpoint_dir(path, write_shards, metadata=None, *, overwrite: bool = True) -> Path:
    path = Path(path)
    parent, name = path.parent, path.name
    staging = parent / f"_tmp_{name}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    write_shards(staging)
    dist.barrier()
    if dist.get_rank() == 0:
        if path.exists() and not path.is_symlink():
            raise NotImplementedError(f"{path} is a real directory, not a version symlink")
        version = parent / f"_version_{name}_{uuid.uuid4().hex}"
        os.rename(staging, version)
        link = parent / f".{name}.link-{uuid.uuid4().hex[:8]}"
        os.symlink(version.name, link)
        os.replace(link, path)
    dist.barrier()
    return path
