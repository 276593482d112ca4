// Opens a Trace Event file in speedscope, in headless Chromium, as a user would (the page's file input), and walks
// its tracks: tests/test_timeline_browser.py runs it and checks what it prints.
//
//   node tests/browser/open_timeline.mjs TRACE.json OUT_DIR [CHROMIUM]
//
// Prints one JSON object: every track's title in speedscope's order, the page's errors (uncaught exceptions, console
// errors, dialogs) and speedscope's warnings about slices that do not nest; writes OUT_DIR/track<k>.png for each
// rank's phases track and first all-reduce track. Offline: speedscope's release is a local page.
import fs from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { chromium } from 'playwright-core'

const [trace, outDir, executablePath = '/usr/bin/chromium'] = process.argv.slice(2)
const here = path.dirname(fileURLToPath(import.meta.url))
const page_ = path.join(here, 'node_modules', 'speedscope', 'dist', 'release', 'index.html')
const profile = fs.mkdtempSync(path.join(outDir, 'chromium-profile-'))  // a fresh --user-data-dir

const context = await chromium.launchPersistentContext(profile, {
  executablePath,
  headless: true,
  viewport: { width: 1400, height: 700 },
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
})
const found = { titles: [], errors: [], warnings: [], shots: {} }
try {
  const page = context.pages()[0] ?? await context.newPage()
  page.on('pageerror', e => found.errors.push(`uncaught: ${e.message}`))
  page.on('dialog', d => { found.errors.push(`dialog: ${d.message()}`); d.dismiss() })
  page.on('console', m => {
    if (m.type() === 'error') found.errors.push(`console: ${m.text()}`)
    if (m.type() === 'warning') found.warnings.push(m.text())
  })
  page.on('requestfailed', r => found.errors.push(`request failed: ${r.url()}`))
  await page.goto('file://' + page_)
  await page.setInputFiles('input[type=file]', trace)
  // The toolbar's title: the track's name and "(k/N)", in a span of its own.
  const title = () => page.evaluate(() => {
    const bar = [...document.querySelectorAll('span')].find(s => /\(\d+\/\d+\)$/.test(s.textContent.trim())
      && s.children.length === 1)
    return bar ? bar.textContent.trim() : null
  })
  await page.waitForFunction(() => /\(\d+\/\d+\)/.test(document.body.innerText), null, { timeout: 30000 })
  const count = Number((await title()).match(/\((\d+)\/(\d+)\)$/)[2])
  for (let k = 0; k < count; k++) {
    if (k > 0) {
      const before = await title()
      await page.keyboard.press('n')  // speedscope: the next track
      await page.waitForFunction(t => !document.body.innerText.includes(t), before, { timeout: 10000 })
    }
    const now = await title()
    found.titles.push(now)
    if (/, (phases \(tid 1\)|all-reduce \(tid 2\)) \(\d+\/\d+\)$/.test(now)) {
      await page.waitForTimeout(300)  // a frame or two for the canvas
      const shot = path.join(outDir, `track${k}.png`)
      await page.screenshot({ path: shot })
      found.shots[now] = shot
    }
  }
} finally {
  await context.close()
  fs.rmSync(profile, { recursive: true, force: true })
}
console.log(JSON.stringify(found))
