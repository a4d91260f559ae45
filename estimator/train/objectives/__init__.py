"""The built-in loop's objectives: what a batch's loss is, and the sums its epoch's numbers come from. One class
each, chosen once on the driver, from the params, by the first of OBJECTIVES (estimator.train.objectives.registry)
whose `applies(p)` is true, and carried to the ranks in the launch's payload (estimator.core.spec.UserObjects.objective), so that a class added
to the registry reaches the ranks whether or not they can import it. A train_fn replaces the loop and has none.

An objective class derives from `BuiltIn` (estimator.train.objectives.base) and has:

- `applies(p)` (a classmethod): whether it is the fit's objective, from the validated params (`p["model"]` the
  driver's module);
- `for_rank(spec, objs, model, trainer)` (a classmethod): the objective a rank trains with;
- `layout`: the names of its sums (estimator.train.sums: `loss`, `loss_weight`, `rows`, then its metrics');
- `weighting`: what its loss is a mean or a sum over (estimator.train.weighting: PerBatch or PerWeight, whose
  `weight_of(batch)` the objective then gives);
- `on_batch(model, batch, ctx)`: the loss for backward and the batch's sums, a float64 vector in `layout`'s order;
- `summarize(train, val)`: the epoch's history row from the sums reduced over the ranks, by name;
- `check_fit(p, shards_checkpoints)` (a classmethod): the params it refuses for the fit, on the driver;
  `reference_table(p)`: the name of a table the ranks compute before training (DPO's reference), or None;
- `before_training(spec, ctx, objs, model)` (a classmethod): what a rank does with the model as built;
- `prepare(generation, batch, ctx)`: the batch its loss is computed on, made before each step (a sampling
  objective generates there: Strategy.generation);
- `transform_output`: the fitted TorchModel's output_kind (None: the model's outputs);
- `rows`: a causal LM's objective names the rows it reads (estimator.fit.language.ROWS: 'sft', 'preference'),
  whose format (estimator.data.rows) tokenizes and labels them; None for any other.

The hooks before training (applies, history_keys, check_fit, reference_table, before_training, for_rank) are
classmethods, called on the chosen class or on the objective param's instance alike: one that needs the
instance's settings (DPO's) reads it from `p["objective"]` on the driver and `objs.objective` on a rank. on_batch,
prepare and summarize are the methods of the instance for_rank returns.

Adding one is a module of its own with its class and a line in OBJECTIVES, before the objectives it takes
precedence over (CONTRIBUTING.md, 'Adding an objective'). torch only, no pyspark."""
