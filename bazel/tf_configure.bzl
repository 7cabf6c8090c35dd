"""`tf_configure`: a repository holding the TensorFlow of one Python interpreter.

The op library must be compiled against the exact TensorFlow that will load it
(its C++ ABI changes every release), so nothing is downloaded: this rule runs
the Python interpreter the user trains with, asks TensorFlow where its headers
and framework library are and which macros it was built with, and links those
into an external repository:

    @local_tensorflow//:tensorflow        headers + libtensorflow_framework
    @local_tensorflow//:python_headers    Python.h, for the _core module
    @local_tensorflow//:pybind11_headers  pybind11, for the _core module
    @local_tensorflow//:config.bzl        TF_VERSION, PYTHON_EXTENSION_SUFFIX, ...

The interpreter is $PYTHON_BIN_PATH if set (`--repo_env=PYTHON_BIN_PATH=...`),
else the first `python3` on PATH, i.e. the active virtual environment's.
"""

MIN_TF_VERSION = (2, 16)

# Printed as one JSON line; everything the BUILD file needs from this Python.
# TensorFlow and pybind11 are optional here: without them only the targets
# that need them fail (with the reason), and the core still builds.
_PROBE = """
import json, os, sys, sysconfig
info = {
    "python": sys.executable,
    "python_include": sysconfig.get_paths()["include"],
    "extension_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    "tf_error": "",
    "pybind11_include": "",
}
try:
    import tensorflow as tf
    flags = tf.sysconfig.get_compile_flags()
    lib_dir = tf.sysconfig.get_lib()
    framework = ""
    for flag in tf.sysconfig.get_link_flags():
        if flag.startswith("-L"):
            lib_dir = flag[2:]
        elif flag.startswith("-l:"):
            framework = flag[3:]
        elif flag.startswith("-l"):
            framework = "lib" + flag[2:] + ".so"
    info.update(
        version=tf.__version__,
        include=tf.sysconfig.get_include(),
        defines=[f[2:] for f in flags if f.startswith("-D")],
        framework=os.path.join(lib_dir, framework) if framework else "",
    )
except Exception as exc:
    info["tf_error"] = "%s: %s" % (type(exc).__name__, exc)
try:
    import pybind11
    info["pybind11_include"] = pybind11.get_include()
except ImportError:
    pass
print(json.dumps(info))
"""

def _python_interpreter(rctx):
    explicit = rctx.os.environ.get("PYTHON_BIN_PATH", "").strip()
    if explicit:
        return explicit
    for name in ("python3", "python"):
        found = rctx.which(name)
        if found:
            return str(found)
    fail("bps_tf: no Python interpreter found. Activate the environment that has " +
         "TensorFlow, or pass --repo_env=PYTHON_BIN_PATH=/path/to/python.")

def _probe(rctx, python):
    result = rctx.execute(
        [python, "-c", _PROBE],
        environment = {"TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout = 300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.return_code != 0 or not lines:
        fail("bps_tf: could not run {python} to find TensorFlow:\n{out}{err}".format(
            python = python,
            out = result.stdout[-1000:],
            err = result.stderr[-2000:],
        ))
    return json.decode(lines[-1])

def _tensorflow_problem(rctx, info):
    """Why the op library cannot be built against this Python, or ""."""
    if info["tf_error"]:
        return ("bps_tf build error: TensorFlow cannot be imported by {python} ({err}). " +
                "Install it first (pip install tensorflow-cpu), or point " +
                "--repo_env=PYTHON_BIN_PATH at the interpreter that has it.").format(
            python = info["python"],
            err = info["tf_error"],
        )
    parts = info["version"].split(".")
    if (int(parts[0]), int(parts[1])) < MIN_TF_VERSION:
        return "bps_tf build error: TensorFlow {v} is too old; bps_tf needs TensorFlow >= {m}.".format(
            v = info["version"],
            m = "%d.%d" % MIN_TF_VERSION,
        )
    if not info["framework"] or not rctx.path(info["framework"]).exists:
        return "bps_tf build error: TensorFlow {v} at {p} has no framework library ({f}); reinstall it.".format(
            v = info["version"],
            p = info["python"],
            f = info["framework"] or "none in tf.sysconfig.get_link_flags()",
        )
    return ""

# A target that fails, with the reason, only when something that needs it is
# built: a missing TensorFlow or pybind11 must not stop the core from building.
_UNAVAILABLE = """genrule(
    name = "{name}_unavailable",
    outs = ["{name}_unavailable.h"],
    cmd = "echo {message} >&2; exit 1",
)

cc_library(
    name = "{name}",
    hdrs = [":{name}_unavailable"],
)
"""

def _unavailable(name, message):
    # Quoted once for BUILD (repr) and once for the shell (single quotes).
    # A genrule's command also expands $(...), so a literal $ is written $$.
    shell_quoted = "'" + message.replace("'", "'\\''").replace("$", "$$") + "'"
    return _UNAVAILABLE.format(name = name, message = repr(shell_quoted)[1:-1])

_TENSORFLOW_FOUND = """cc_library(
    name = "tensorflow_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    # TensorFlow's own -D flags (C++ ABI, Eigen alignment): every object that
    # sees TensorFlow types must agree with the library that defines them.
    defines = {defines},
)

cc_import(
    name = "tensorflow_framework",
    shared_library = "lib/{framework_name}",
)

cc_library(
    name = "tensorflow",
    deps = [
        ":tensorflow_framework",
        ":tensorflow_headers",
    ],
)
"""

_PYBIND11_FOUND = """cc_library(
    name = "pybind11_headers",
    hdrs = glob(["pybind11_include/**/*.h"]),
    includes = ["pybind11_include"],
)
"""

_BUILD_HEADER = """# Generated by //bazel:tf_configure.bzl from {python} ({version}).
# After changing that Python's packages, run `bazel sync --configure`.
package(default_visibility = ["//visibility:public"])
"""

_PYTHON_HEADERS_FOUND = """cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)
"""

_CONFIG_TEMPLATE = '''"""Facts about the Python and TensorFlow this workspace builds against."""

TF_VERSION = "{version}"
PYTHON_INTERPRETER = "{python}"
PYTHON_EXTENSION_SUFFIX = "{suffix}"
'''

def _tf_configure_impl(rctx):
    python = _python_interpreter(rctx)
    info = _probe(rctx, python)

    # Links, not copies: TensorFlow's headers are hundreds of megabytes.
    if rctx.path(info["python_include"]).get_child("Python.h").exists:
        rctx.symlink(info["python_include"], "python_include")
        python_rules = _PYTHON_HEADERS_FOUND
    else:
        python_rules = _unavailable(
            "python_headers",
            "bps_tf build error: {} has no Python.h in {}; install the Python development headers (e.g. python3-dev)".format(
                info["python"],
                info["python_include"],
            ),
        )
    problem = _tensorflow_problem(rctx, info)
    if problem:
        version = "no usable TensorFlow"
        tensorflow_rules = _unavailable("tensorflow", problem)
    else:
        version = "TensorFlow " + info["version"]
        rctx.symlink(info["include"], "include")
        framework_name = info["framework"].split("/")[-1]
        rctx.symlink(info["framework"], "lib/" + framework_name)
        tensorflow_rules = _TENSORFLOW_FOUND.format(
            defines = repr(info["defines"]),
            framework_name = framework_name,
        )
    if info["pybind11_include"]:
        rctx.symlink(info["pybind11_include"], "pybind11_include")
        pybind11_rules = _PYBIND11_FOUND
    else:
        pybind11_rules = _unavailable(
            "pybind11_headers",
            "bps_tf build error: pybind11 is not installed for {}; run pip install pybind11".format(
                info["python"],
            ),
        )

    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", "\n".join([
        _BUILD_HEADER.format(python = info["python"], version = version),
        python_rules,
        tensorflow_rules,
        pybind11_rules,
    ]))
    rctx.file("config.bzl", _CONFIG_TEMPLATE.format(
        version = info.get("version", ""),
        python = info["python"],
        suffix = info["extension_suffix"],
    ))

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH", "PATH", "VIRTUAL_ENV"],
    configure = True,
    local = True,
    doc = "Links the TensorFlow of the active Python into an external repository.",
)
