"""Repositories that Bazel 4's built-in tools load, served without a network.

Bazel's own toolchain files load `@rules_cc//cc:defs.bzl` and
`@rules_java//java:defs.bzl`, and by default Bazel downloads both. bps_tf
builds with the Debian `bazel-bootstrap` package on machines that may have no
network, so both repositories are provided locally instead:

* `rules_cc`: the Debian package of rules_cc is a different release than
  Bazel 4.2.3 expects, so this writes a tiny one whose macros forward to the
  rules built into Bazel, which is all the real one does for these names;
* `rules_java`: Debian's `bazel-rules-java` package installs a matching copy
  under /usr/share/bazel/rules/java, which is linked in as it is.
"""

_CC_RULES = [
    "cc_binary",
    "cc_import",
    "cc_library",
    "cc_proto_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "fdo_prefetch_hints",
    "fdo_profile",
    "objc_import",
    "objc_library",
]

def _forwarder(name):
    return "def {name}(**attrs):\n    native.{name}(**attrs)\n".format(name = name)

def _native_rules_cc_impl(rctx):
    rctx.file("WORKSPACE", 'workspace(name = "rules_cc")\n')
    rctx.file("BUILD", "")
    rctx.file(
        "cc/defs.bzl",
        '"""Forwards the C++ rules to the ones built into Bazel."""\n\n' +
        "\n".join([_forwarder(name) for name in _CC_RULES]),
    )

    # Starlark cc rules in @bazel_tools name the toolchain type through rules_cc.
    rctx.file("cc/BUILD", "\n".join([
        'package(default_visibility = ["//visibility:public"])',
        'exports_files(["defs.bzl"])',
        "alias(",
        '    name = "toolchain_type",',
        '    actual = "@bazel_tools//tools/cpp:toolchain_type",',
        ")",
        "",
    ]))

native_rules_cc = repository_rule(
    implementation = _native_rules_cc_impl,
    doc = "A local rules_cc whose macros call Bazel's native C++ rules.",
)

_DEBIAN_RULES_JAVA = "/usr/share/bazel/rules/java"

def _system_rules_java_impl(rctx):
    root = rctx.path(rctx.attr.path)
    if not root.get_child("java").get_child("defs.bzl").exists:
        fail(("rules_java was not found at {path}. Install Debian's package " +
              "(`apt-get install bazel-rules-java`) or point the `path` of " +
              "system_rules_java in WORKSPACE at another copy.").format(path = rctx.attr.path))
    for child in root.readdir():
        rctx.symlink(child, child.basename)

system_rules_java = repository_rule(
    implementation = _system_rules_java_impl,
    attrs = {"path": attr.string(default = _DEBIAN_RULES_JAVA)},
    doc = "Links an installed copy of rules_java (Debian's by default).",
    local = True,
)
