"""A classifier's MLflow model: its PyTorch model answering with the class of each row and a score per
class, by name (`data.class_names`), so that `mlflow models serve` answers

    {"predictions": [{"class": "zero", "one": -0.42, "two": -1.64, "zero": 3.59}]}

This file is logged with the model as its code (MLflow's models from code) and runs where the model
is loaded: it imports MLflow, numpy and pandas (and, through MLflow's PyTorch model, torch), never this
service. Rows that are not a batch of the size the model was trained on are refused with a short
message naming both shapes (the signature names the outputs and leaves the input to this check:
MLflow's own refusal prints the whole input first).
"""

from __future__ import annotations

import json
from typing import Any

import mlflow
import numpy as np
import pandas as pd

CLASS = "class"  # the column of each row's most likely class


class NamedScores(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        self.model = mlflow.pyfunc.load_model(context.artifacts["pytorch"])  # MLflow's PyTorch model
        with open(context.artifacts["outputs"]) as f:
            described = json.load(f)
        self.names, self.row_shape = described["class_names"], tuple(described["row_shape"])
        self.dtype = np.dtype(described["dtype"])

    def predict(self, context: Any, model_input: Any, params: dict | None = None) -> pd.DataFrame:
        rows = np.asarray(model_input)
        if rows.shape[1:] != self.row_shape:
            each = " × ".join(map(str, self.row_shape)) or "a scalar"
            raise ValueError(
                f"expects a batch of rows of {each} (shape (N, {', '.join(map(str, self.row_shape))})), "
                f"got an input of shape {rows.shape}: add the batch dimension, or resize the rows to the trained size"
            )
        if rows.dtype != self.dtype:  # JSON's numbers arrive as int64 or float64
            cast = rows.astype(self.dtype)
            if self.dtype.kind in "iub" and not np.array_equal(cast, rows):  # pixels as uint8, say
                raise ValueError(f"expects {self.dtype} values, got {rows.dtype} ones that {self.dtype} cannot hold")
            rows = cast
        return named(np.asarray(self.model.predict(rows)), self.names)


def named(scores: np.ndarray, names: list[str]) -> pd.DataFrame:
    """Each row's most likely class, then its score for every class, by name."""
    frame = pd.DataFrame(scores, columns=names)
    frame.insert(0, CLASS, np.asarray(names)[scores.argmax(axis=1)])
    return frame


mlflow.models.set_model(NamedScores())
