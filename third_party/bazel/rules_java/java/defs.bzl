"""Stand-in for @rules_java//java:defs.bzl, which @bazel_tools loads while it registers its Java
toolchains (unused here: nothing in the build is Java)."""

java_binary = native.java_binary
java_import = native.java_import
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
