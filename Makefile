# The two commands of the README: `make serve` and `make test`. Both set everything up first.
.PHONY: setup serve test clean

setup: .venv/.setup-done

# (a changed kernel source reruns setup, which rebuilds the CPU kernels: `jaxserve build-kernels`)
.venv/.setup-done: pyproject.toml scripts/setup.sh $(wildcard cpu_kernels/csrc/*.cc)
	bash scripts/setup.sh
	touch $@

serve: setup
	.venv/bin/jaxserve serve $(ARGS)

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf .venv .pytest_cache .jax_cache
