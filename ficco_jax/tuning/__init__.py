"""Choosing a schedule: the cost model and its machine profiles (`cost_model`, `profiles/*.json`),
fitting a profile (`fitting`), the model's pick (`select`), the measured pick and its cache
(`autotune`), what "auto"/"autotune" resolve to (`policy`), and the device-time method (`timing`)."""
