"""The benchmarks DARE evaluates on; importing this package registers every one of them in `BENCHMARKS`."""
from dare_core.eval.configs.base import (BENCHMARKS, Benchmark, MissingBenchmarkData, get_benchmark, parse_benchmarks,
                                         register_benchmark)
from dare_core.eval.configs import (  # noqa: F401  (registration, in the order benchmarks are listed)
    mmlu, mmlu_pro, hellaswag, arc, gsm8k, hendrycks_math, gpqa, aime, olympiadbench, humaneval, mbpp, task)

__all__ = ["BENCHMARKS", "Benchmark", "MissingBenchmarkData", "get_benchmark", "parse_benchmarks", "register_benchmark"]
