"""Prediction and persistence: batched forward passes on the executors (inference: Arrow in, Arrow out, one
model per Python worker) and save/load of TorchEstimator and TorchModel (persistence). Imports train (the
devices, a LightningModule's predict_step) and core; never fit."""
