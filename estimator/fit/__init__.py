"""The fit on the driver: params checked before any Spark job, the dry run on a few rows, the DataFrame
materialized as Parquet (or computed by the ranks: direct), launches and retries, what the user sees while the
ranks train and after (report, progress), MLflow. The top of the house: it may import every other folder
(core, data, launch, train, predict); nothing imports it but estimator.estimator."""
