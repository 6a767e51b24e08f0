# Writes ${OUT} from ${IN} with the current git commit (suffix "-dirty" for uncommitted changes); rewrites
# the file only when its content changes, so an unchanged commit triggers no rebuild.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE KVSIM_GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT KVSIM_GIT_COMMIT)
  set(KVSIM_GIT_COMMIT "unknown")
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE _dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_dirty)
    set(KVSIM_GIT_COMMIT "${KVSIM_GIT_COMMIT}-dirty")
  endif()
endif()
configure_file(${IN} ${OUT} @ONLY)
