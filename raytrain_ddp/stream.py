"""Streamed datasets, as a recipe's `build_datasets` returns them (the public names; how they are
listed, planned and read lives in `raytrain_ddp/data/`):

    from raytrain_ddp import stream

    def build_datasets(*, seed, path):
        return {"train": stream.ImageFolder(f"{path}/train", size=(32, 32), transform=augment),
                "val": stream.ImageFolder(f"{path}/val", size=(32, 32))}
"""

from raytrain_ddp.data.stream import BadFile, Blocks, ImageFolder, Manifest, Parquet, Stream

__all__ = ["BadFile", "Blocks", "ImageFolder", "Manifest", "Parquet", "Stream"]
