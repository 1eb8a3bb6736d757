// The e2b SDK, unmodified, driving carrel: run by tests/e2b_test.go with
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at carreld's e2b
// API, and TEMPLATE naming a carrel image. It prints one JSON object of
// what it saw; the Go test checks it.
const { Sandbox, CommandExitError } = require('e2b')

async function main () {
  const out = {}
  const sbx = await Sandbox.create(process.env.TEMPLATE, {
    envs: { GREETING: 'hello from e2b' },
    metadata: { purpose: 'carrel-test' },
    timeoutMs: 10 * 60 * 1000
  })
  out.sandboxId = sbx.sandboxId

  const r = await sbx.commands.run('python3 -c "print(6*7)"')
  out.python = { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode }

  const env = await sbx.commands.run('echo "$GREETING"; echo "$ONE"', { envs: { ONE: 'per command' } })
  out.env = env.stdout

  try {
    await sbx.commands.run('echo to-stderr >&2; exit 3')
    out.failing = { thrown: false }
  } catch (e) {
    out.failing = { thrown: e instanceof CommandExitError, exitCode: e.exitCode, stderr: e.stderr }
  }

  await sbx.files.write('/workspace/hello.txt', 'hello, carrel')
  out.read = await sbx.files.read('/workspace/hello.txt')
  await sbx.files.write('notes/relative.txt', 'relative path')
  out.readRelative = await sbx.files.read('/workspace/notes/relative.txt')
  out.list = (await sbx.files.list('/workspace')).map(e => ({ name: e.name, type: e.type, path: e.path }))
  out.exists = await sbx.files.exists('/workspace/hello.txt')
  out.made = await sbx.files.makeDir('/workspace/watched')

  const seen = []
  const watch = await sbx.files.watchDir('/workspace/watched', ev => seen.push(ev))
  await sbx.files.write('/workspace/watched/new.txt', 'watch me')
  for (let i = 0; i < 100 && !seen.some(ev => ev.name === 'new.txt'); i++) {
    await new Promise(resolve => setTimeout(resolve, 100))
  }
  await watch.stop()
  out.watched = seen.map(ev => ({ name: ev.name, type: ev.type }))

  let echoed = ''
  const bg = await sbx.commands.run('cat', { background: true, stdin: true, onStdout: d => { echoed += d } })
  out.background = { pid: bg.pid }
  await sbx.commands.sendStdin(bg.pid, 'ping over stdin\n')
  for (let i = 0; i < 100 && !echoed.includes('ping'); i++) {
    await new Promise(resolve => setTimeout(resolve, 100))
  }
  out.background.echoed = echoed
  out.background.listed = (await sbx.commands.list()).some(p => p.pid === bg.pid)
  out.background.killed = await bg.kill()
  try {
    await bg.wait()
    out.background.waited = 'exited normally'
  } catch (e) {
    out.background.waited = e instanceof CommandExitError ? `exit ${e.exitCode}` : String(e)
  }

  // Connect follows a command started earlier to its end.
  const later = await sbx.commands.run('sleep 1; echo done later', { background: true })
  const followed = await sbx.commands.connect(later.pid)
  out.connected = (await followed.wait()).stdout

  // A terminal: input, a resize, output, kill.
  let screen = ''
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: d => { screen += Buffer.from(d).toString() } })
  await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(term.pid, Buffer.from('stty size; echo pty-$((6*7))\n'))
  for (let i = 0; i < 100 && !screen.includes('pty-42'); i++) {
    await new Promise(resolve => setTimeout(resolve, 100))
  }
  out.pty = { answered: screen.includes('pty-42'), resized: screen.includes('30 100'), killed: await sbx.pty.kill(term.pid) }

  // Rename and remove.
  const moved = await sbx.files.rename('/workspace/notes/relative.txt', '/workspace/moved.txt')
  await sbx.files.remove('/workspace/notes')
  out.moved = { path: moved.path, notesGone: !(await sbx.files.exists('/workspace/notes')), read: await sbx.files.read('/workspace/moved.txt') }

  // A pause keeps the memory: a command still runs after the resume.
  const sleeper = await sbx.commands.run('sleep 600', { background: true })
  out.paused = await sbx.pause()
  out.pausedState = (await Sandbox.getInfo(sbx.sandboxId)).state
  out.pausedAgain = await sbx.pause()
  await sbx.connect()
  out.resumed = {
    sleeperAlive: (await sbx.commands.list()).some(p => p.pid === sleeper.pid),
    read: await sbx.files.read('/workspace/hello.txt')
  }
  await sbx.commands.kill(sleeper.pid)

  const listed = await Sandbox.list({ query: { metadata: { purpose: 'carrel-test' } } }).nextItems()
  out.listed = listed.map(s => s.sandboxId)
  const info = await sbx.getInfo()
  out.info = { templateId: info.templateId, state: info.state, metadata: info.metadata }
  out.running = await sbx.isRunning()

  out.killed = await sbx.kill()
  out.killedAgain = await Sandbox.kill(sbx.sandboxId)
  console.log(JSON.stringify(out))
}

main().catch(e => {
  console.error(e && e.stack ? e.stack : e)
  process.exit(1)
})
