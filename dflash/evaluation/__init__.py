"""One evaluation and its orchestration, read in this order: `logged` (open the MLflow run, evaluate, log the
result: written once, for the command line, the API and every step of a training run) -> `pipeline` (config ->
load -> references -> features -> replay -> metrics, returning dflash.result.EvalResult) -> the stages
(dflash/stages/). Beside them: `series` (a training run step by step, `follow=true`), `api` (`dflash.evaluate`
from Python), `preflight` (input checks before torch loads) and `checks` (what a run warns about)."""
