# Sourced by scripts/bootstrap.sh and scripts/bootstrap_vllm.sh (both set VENV): installing into $VENV with pip's
# own package sources, through pip or through uv.

# pip warns once per index entry this machine's mirror lacks; those lines say nothing about what is installed.
pip_install() {
  "$VENV/bin/pip" install -q "$@" 2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" -e "^ *!!" -e "^ *\*\*\*" \
    -e "Please be careful with folders" -e "name as your package" -e "with strategy, WheelFile" -e "^ *$" >&2)
}

# Appends to the array uv_args uv's arguments for the package sources pip is configured with (pip.conf, PIP_*
# variables, as `$VENV/bin/pip config list` reports them): the index, the extra indexes and find-links, constraint
# files, the certificate bundle (exported as SSL_CERT_FILE). Every source is searched for the best match, as pip
# does (uv's default stops at the first index that has a package).
uv_pip_sources() {
  local line key value v
  uv_args+=(--index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*} key=${key##*.} value=${line#*=} value=${value#\'} value=${value%\'}
    for v in $value; do
      case $key in
        index-url) uv_args+=(--index-url "$v") ;;
        extra-index-url) uv_args+=(--extra-index-url "$v") ;;
        find-links) uv_args+=(--find-links "$v") ;;
        constraint) [ -f "$v" ] && uv_args+=(--constraint "$v") ;;
        cert) [ -f "$v" ] && export SSL_CERT_FILE="$v" ;;
      esac
    done
  done < <("$VENV/bin/pip" config list 2>/dev/null)
}
