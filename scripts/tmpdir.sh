# private_tmpdir VAR NAME: a new folder ${TMPDIR:-/tmp}/toast-NAME.XXXXXX in the
# variable VAR, removed when the sourcing script exits (bash runs the EXIT trap
# on a normal end, on an error under `set -e`, on Ctrl-C and on SIGTERM). A run
# killed with SIGKILL cannot run it, so the folder records its owner's pid and
# every call first removes the toast-NAME folders whose owner is gone. A folder
# with no owner recorded (written by an older script, or being created this
# instant) is removed once it is an hour old.
private_tmpdir() {
    local var="$1" prefix="${TMPDIR:-/tmp}/toast-$2." old owner dir
    for old in "$prefix"*; do
        [ -d "$old" ] || continue
        owner="$(cat "$old/.owner" 2>/dev/null || true)"
        if [ -n "$owner" ]; then
            kill -0 "$owner" 2>/dev/null && continue
        elif [ -z "$(find "$old" -maxdepth 0 -mmin +60)" ]; then
            continue
        fi
        rm -rf "$old"
    done
    dir="$(mktemp -d "${prefix}XXXXXX")"
    echo "$$" > "$dir/.owner"
    printf -v "$var" '%s' "$dir"
    # shellcheck disable=SC2064  # the folder's name is fixed now
    trap "rm -rf '$dir'" EXIT
}
