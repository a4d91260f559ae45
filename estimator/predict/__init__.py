"""Prediction and persistence: TorchModel.transform's batched inference on the executors and save/load of
TorchEstimator and TorchModel (persistence). Imports train (the devices, a LightningModule's predict_step), data
and core; never fit.

What transform adds is an output kind, chosen by TorchModel's `output_kind` param. Each kind is a predictor
(predictor.py): plain frozen data that TorchModel builds once on the driver from its params, checking what the
kind cannot run; it names the columns transform adds, the Arrow struct the UDF returns, and how one batch is
predicted with the model. The kinds are in kinds/, one module each (values.py: the forward's numbers and Spark
ML's prediction columns; generate.py: generated text; embedding.py: a vector per row), and the registry that maps
each `output_kind` value to its class is `PREDICTORS` in kinds/__init__.py. What every kind shares runs in
inference.py (Arrow in, Arrow out, one model per Python worker, the pandas UDF of pyspark 3.5); generation.py
holds the torch of generating and pooling. On the driver only: schema.py (the Spark types of the added columns)
and language_checks.py (a language model's param checks, which fit/ shares)."""
