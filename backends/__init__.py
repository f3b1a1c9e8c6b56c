"""HAL implementations, one subpackage per platform (`epd_serve.backends.<name>`).

Each subpackage exposes `PLATFORM`, an `epd_serve.hal.Platform`. Importing one must not
import its hardware packages: those load lazily in `check_available()`.
"""
