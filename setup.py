"""The C extension alone; everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional: without a C compiler the install goes on and route() keeps its pure-Python path.
setup(ext_modules=[Extension("prismlb.router._fastroute", ["router/_fastroute.c"], optional=True)])
