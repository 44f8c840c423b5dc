<#
Install the Anima trainer into .\venv and check it (Windows; the twin of install.sh).

  powershell -ExecutionPolicy Bypass -File install.ps1            create or update venv\ (a second run with nothing changed installs nothing)
  powershell -ExecutionPolicy Bypass -File install.ps1 -Recreate  delete venv\ first and start clean

Environment:
  ANIMA_PYTHON      interpreter to build the venv from (default: py -3.11, else py -3.12, else py -3.13, else python on
                    PATH if it is 3.11-3.13)
  ANIMA_TORCH_SPEC  what to pip-install when the venv has no working torch (default: "torch torchvision", i.e. pip
                    chooses the build, which on Windows is a CPU-only one; for CUDA e.g.
                    "torch torchvision --index-url https://download.pytorch.org/whl/cu128")

Not for ComfyUI portable: there the nodes use python_embeded (README, "Windows and ComfyUI portable").
#>
param([switch]$Recreate, [switch]$Help)
$ErrorActionPreference = "Stop"
Set-Location -LiteralPath $PSScriptRoot

if ($Help) { Get-Content -LiteralPath $PSCommandPath -TotalCount 15 | Select-Object -Skip 1; exit 0 }

$Venv = "venv"
$VenvPython = Join-Path $Venv "Scripts\python.exe"
$Stamp = Join-Path $Venv ".anima-train-install"

function Say([string]$Text) { Write-Host "install.ps1: $Text" }
function Fail([string]$Text) { [Console]::Error.WriteLine("install.ps1: $Text"); exit 1 }

# Runs a command given as an array (program, then its leading arguments) with more arguments; returns its output.
function Run([string[]]$Command, [string[]]$Arguments) {
    $program = $Command[0]
    $lead = @($Command | Select-Object -Skip 1)
    & $program @lead @Arguments
}

# Output of a probe whose failure is an answer, or $null. (Windows PowerShell turns a redirected stderr line into an
# error record, which "Stop" would make fatal: probes run under "Continue".)
function Probe([string[]]$Command, [string[]]$Arguments) {
    $old = $ErrorActionPreference
    $ErrorActionPreference = "Continue"
    try {
        $out = Run $Command $Arguments 2>$null
        if ($LASTEXITCODE -eq 0) { return "$out".Trim() }
    } catch { } finally { $ErrorActionPreference = $old }
    return $null
}

function Python-Version([string[]]$Command) {
    return Probe $Command @("-c", "import sys; print('%d.%d' % sys.version_info[:2])")
}

function Pick-Python {
    if ($env:ANIMA_PYTHON) { return , @($env:ANIMA_PYTHON) }
    foreach ($cand in @(@("py", "-3.11"), @("py", "-3.12"), @("py", "-3.13"), @("python"))) {
        $ver = Python-Version $cand
        if ($ver -eq "3.11" -or $ver -eq "3.12" -or $ver -eq "3.13") { return , $cand }
    }
    return $null
}

if ($Recreate -and (Test-Path -LiteralPath $Venv)) {
    Say "-Recreate: removing $Venv\"
    Remove-Item -LiteralPath $Venv -Recurse -Force
}

if (-not (Test-Path -LiteralPath $VenvPython)) {
    $py = Pick-Python
    if (-not $py) {
        Fail ("no Python 3.11, 3.12 or 3.13 found. Install one from python.org (it brings the py launcher), " +
              "or point ANIMA_PYTHON at it.")
    }
    $ver = Python-Version $py
    if ($ver -ne "3.11" -and -not $env:ANIMA_PYTHON) { Say "Python 3.11 not found; falling back to $($py -join ' ') ($ver)" }
    Say "creating $Venv\ with $($py -join ' ') ($ver)"
    Run $py @("-m", "venv", $Venv)
    if ($LASTEXITCODE -ne 0) { Fail "creating $Venv\ failed" }
}

$Pip = @($VenvPython, "-m", "pip", "--disable-pip-version-check")

# torch: ComfyUI (and users with a particular CUDA) own their torch, so only install one when none works.
if ($null -ne (Probe @($VenvPython) @("-c", "import torch, torchvision; torch.ones(1) + 1"))) {
    Say "torch already works in ${Venv}: $(& $VenvPython -c 'import torch; print(torch.__version__)')"
} else {
    $spec = if ($env:ANIMA_TORCH_SPEC) { $env:ANIMA_TORCH_SPEC } else { "torch torchvision" }
    Say "installing $spec (this is the big download on a new machine)"
    Run $Pip (@("install", "-q") + ($spec -split '\s+' | Where-Object { $_ }))
    if ($LASTEXITCODE -ne 0) { Fail "pip could not install $spec" }
}
$cuda = (& $VenvPython -c "import torch; print(torch.version.cuda or '')").Trim()
if (-not $cuda) {
    Say ("note: this torch is a CPU-only build (PyPI's Windows default). For the GPU: set ANIMA_TORCH_SPEC to e.g. " +
         "'torch torchvision --index-url https://download.pytorch.org/whl/cu128' and run with -Recreate")
}

# The project itself, editable, with test extras. Skipped when nothing it depends on has changed.
$want = (& $VenvPython -c ("import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read() + " +
                           "open('requirements.txt', 'rb').read()).hexdigest())")).Trim()
$have = if (Test-Path -LiteralPath $Stamp) { (Get-Content -LiteralPath $Stamp -Raw).Trim() } else { "" }
$importable = ($null -ne (Probe @($VenvPython) @("-c", "import anima_train, anchor, pytest")))
if ($have -eq $want -and $importable -and (Test-Path -LiteralPath (Join-Path $Venv "Scripts\anima-train.exe"))) {
    Say "dependencies up to date (pyproject.toml and requirements.txt unchanged)"
} else {
    Say "installing the project (editable) with its dependencies"
    Run $Pip @("install", "-q", "-e", ".[dev]")
    if ($LASTEXITCODE -ne 0) { Fail "pip could not install the project" }
    Set-Content -LiteralPath "$Stamp.tmp" -Value $want -NoNewline
    Move-Item -LiteralPath "$Stamp.tmp" -Destination $Stamp -Force
}

& (Join-Path $Venv "Scripts\anima-train.exe") check
if ($LASTEXITCODE -ne 0) { exit $LASTEXITCODE }
Say "done. Try: $Venv\Scripts\anima-train.exe demo"
