"""TokenIndexer: tokens (``array<string>``, e.g. from ``RegexTokenizer``) -> token ids (``array<int>``) for an embedding.

pyspark.ml has ``StringIndexer`` for one string per row and ``CountVectorizer`` for bags of
words, but nothing that keeps a sequence of tokens as a sequence of ids, which is what an
``nn.Embedding``/``nn.EmbeddingBag`` or a Transformer encoder reads.  Ids are:

- ``0``: padding (sparkdl pads ragged inputs with ``padValue``, 0 by default);
- ``1``: a token outside the vocabulary;
- ``2 ...``: the vocabulary, most frequent token first (ties by the token's text).

>>> Pipeline(stages=[RegexTokenizer(inputCol="text", outputCol="tokens", pattern="\\\\W+"),
...                  TokenIndexer(inputCol="tokens", outputCol="ids", vocabSize=20000),
...                  TorchEstimator(model=make_net, inputCols=["ids"], ...)])
"""
from __future__ import annotations

from typing import Any

import pandas as pd  # the pandas UDF's type hints are resolved in this module's globals
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasInputCol, HasOutputCol
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable
from pyspark.sql import DataFrame

__all__ = ["TokenIndexer", "TokenIndexerModel"]

#: the id of padding positions, and of tokens outside the vocabulary
PAD_ID, UNKNOWN_ID = 0, 1


class _TokenIndexerParams(HasInputCol, HasOutputCol):
    vocabSize = Param(Params._dummy(), "vocabSize", "most frequent tokens kept in the vocabulary",
                      typeConverter=TypeConverters.toInt)
    minCount = Param(Params._dummy(), "minCount", "rows a token must appear in to enter the vocabulary",
                     typeConverter=TypeConverters.toInt)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(vocabSize=20000, minCount=1)


class TokenIndexer(Estimator, _TokenIndexerParams, DefaultParamsReadable, DefaultParamsWritable):
    """Learns a vocabulary from an ``array<string>`` column (one Spark aggregation)."""

    _input_kwargs: dict[str, Any]

    @keyword_only
    def __init__(self, *, inputCol: str | None = None, outputCol: str | None = None, vocabSize: int | None = None,
                 minCount: int | None = None) -> None:
        super().__init__()
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _fit(self, dataset: DataFrame) -> TokenIndexerModel:
        from pyspark.sql import functions as F

        name = self.getInputCol()
        if self.getOrDefault(self.vocabSize) < 1 or self.getOrDefault(self.minCount) < 1:
            raise ValueError("TokenIndexer: vocabSize and minCount must be >= 1")
        # a token counts once per row: its document frequency, as CountVectorizer's minDF
        counts = (dataset.select(F.array_distinct(F.col(f"`{name}`")).alias("tokens"))
                  .select(F.explode("tokens").alias("token")).where(F.col("token").isNotNull())
                  .groupBy("token").count().where(F.col("count") >= self.getOrDefault(self.minCount))
                  .orderBy(F.desc("count"), F.asc("token")).limit(self.getOrDefault(self.vocabSize)))
        vocabulary = [row["token"] for row in counts.collect()]
        model = TokenIndexerModel(vocabulary=vocabulary, inputCol=name, outputCol=self.getOutputCol())
        model._resetUid(self.uid.replace("TokenIndexer", "TokenIndexerModel"))
        return model


class TokenIndexerModel(Model, _TokenIndexerParams, DefaultParamsReadable, DefaultParamsWritable):
    """Maps every token to its id (``1`` outside the vocabulary); a null row stays null."""

    vocabulary = Param(Params._dummy(), "vocabulary", "the tokens; token i has the id i + 2",
                       typeConverter=TypeConverters.toListString)
    _input_kwargs: dict[str, Any]

    @keyword_only
    def __init__(self, *, vocabulary: list[str] | None = None, inputCol: str | None = None,
                 outputCol: str | None = None) -> None:
        super().__init__()
        self._setDefault(vocabulary=[])
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def getVocabulary(self) -> list[str]:
        return self.getOrDefault(self.vocabulary)

    def _transform(self, dataset: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        ids = {token: i + 2 for i, token in enumerate(self.getVocabulary())}

        @F.pandas_udf("array<int>")  # type: ignore[call-overload]
        def token_ids(rows: pd.Series) -> pd.Series:
            return rows.map(lambda tokens: None if tokens is None else [ids.get(t, UNKNOWN_ID) for t in tokens])

        return dataset.withColumn(self.getOutputCol(), token_ids(F.col(f"`{self.getInputCol()}`")))
