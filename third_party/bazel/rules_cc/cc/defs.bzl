"""Stand-in for @rules_cc//cc:defs.bzl: the native C++ rules under their rules_cc names."""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
