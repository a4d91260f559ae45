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
- `transform_output`: the fitted TorchModel's output_kind (None: the model's outputs);
- `language_model`: its rows are a causal LM's prompts and responses, or chats (estimator.data.lm).

Adding one is a module of its own with its class and a line in OBJECTIVES, before the objectives it takes
precedence over (CONTRIBUTING.md, 'Adding an objective'). torch only, no pyspark."""
