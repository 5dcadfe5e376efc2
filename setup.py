"""Only marks the distribution as platform-specific: the wheel carries libfa4_jax.so."""
from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution)
