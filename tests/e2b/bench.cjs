// Times `commands.run('true')` through the e2b SDK against carrel's e2b
// API, for make bench (tests/bench/agents.go): connects to the sandbox
// SANDBOX, warms up, then prints one JSON array of RUNS round trips in
// nanoseconds. Each round trip is the SDK's whole call: a Process.Start
// stream to the end event.
const { Sandbox } = require('e2b')

async function main () {
  const sbx = await Sandbox.connect(process.env.SANDBOX)
  const runs = Number(process.env.RUNS || 50)
  for (let i = 0; i < 3; i++) await sbx.commands.run('true')
  const ns = []
  for (let i = 0; i < runs; i++) {
    const start = process.hrtime.bigint()
    const r = await sbx.commands.run('true')
    ns.push(Number(process.hrtime.bigint() - start))
    if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`)
  }
  console.log(JSON.stringify(ns))
}

main().catch(e => {
  console.error(e && e.stack ? e.stack : e)
  process.exit(1)
})
