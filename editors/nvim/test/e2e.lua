-- End-to-end check of editors/nvim with a real ember server, run by tests/test_nvim.py:
--
--   nvim --headless -n -i NONE -u init.lua   (init.lua puts editors/nvim on 'rtp' and dofile()s this)
--
-- Environment: EMBER_E2E_CMD (JSON list: the server command), EMBER_E2E_FILE (a Python file to
-- edit), EMBER_E2E_OUT (where the JSON result goes), EMBER_E2E_TIMEOUT (seconds to wait for the
-- first non-empty completion, default 180), EMBER_E2E_TYPE (text typed on a new last line),
-- EMBER_E2E_SERVER_ENV (JSON object: extra environment for the server, optional).
--
-- It types through Neovim itself (nvim_feedkeys in insert mode), so didOpen/didChange come from
-- Neovim's LSP client, then asks for completion the way a user would (omnifunc via <C-x><C-o>,
-- after polling with buf_request_sync until the model has loaded) and writes what Neovim received.
local out = { steps = {} }

local function step(name)
  table.insert(out.steps, name)
  -- Also leave a trace on disk, in case Neovim hangs before the result is written.
  local f = io.open(os.getenv('EMBER_E2E_OUT') .. '.steps', 'a')
  if f then
    f:write(name .. '\n')
    f:close()
  end
end

local function write_out()
  local path = os.getenv('EMBER_E2E_OUT')
  local f = assert(io.open(path, 'w'))
  f:write(vim.fn.json_encode(out))
  f:close()
end

local function get_clients(bufnr)
  if vim.lsp.get_clients then
    return vim.lsp.get_clients({ bufnr = bufnr })
  end
  local list = {}
  for _, c in pairs(vim.lsp.buf_get_clients(bufnr)) do
    table.insert(list, c)
  end
  return list
end

local function item_text(item)
  if type(item.textEdit) == 'table' and type(item.textEdit.newText) == 'string' then
    return item.textEdit.newText
  end
  if type(item.insertText) == 'string' then
    return item.insertText
  end
  return item.label or ''
end

local function extract_items(result)
  if type(result) ~= 'table' then
    return {}
  end
  if result.items then
    return result.items
  end
  return result
end

local function to_complete_items(result, prefix, client_id)
  if vim.lsp.completion and vim.lsp.completion._lsp_to_complete_items then
    return vim.lsp.completion._lsp_to_complete_items(result, prefix, client_id)
  end
  return vim.lsp.util.text_document_completion_list_to_complete_items(result, prefix)
end

local function keys(s)
  return vim.api.nvim_replace_termcodes(s, true, false, true)
end

local function main()
  local cmd = vim.fn.json_decode(os.getenv('EMBER_E2E_CMD'))
  local file = os.getenv('EMBER_E2E_FILE')
  local timeout_s = tonumber(os.getenv('EMBER_E2E_TIMEOUT') or '180')
  local typed = os.getenv('EMBER_E2E_TYPE') or '    return n * '
  local v = vim.version()
  out.nvim_version = string.format('%d.%d.%d', v.major, v.minor, v.patch)
  out.has_lsp_start = vim.lsp.start ~= nil
  out.has_inline_completion = vim.lsp.inline_completion ~= nil
  vim.lsp.set_log_level('debug')
  out.lsp_log = vim.lsp.get_log_path()

  local ember = require('ember')
  local server_env = os.getenv('EMBER_E2E_SERVER_ENV')
  ember.setup({
    cmd = cmd,
    cmd_env = server_env and vim.fn.json_decode(server_env) or nil,
    filetypes = { 'python' },
    settings = { maxTokens = 24, debounceMs = 0, temperature = 0 },
  })
  step('setup')

  vim.cmd('edit ' .. vim.fn.fnameescape(file))
  local bufnr = vim.api.nvim_get_current_buf()
  out.filetype = vim.bo[bufnr].filetype
  out.omnifunc = vim.bo[bufnr].omnifunc

  local client
  local ok = vim.wait(60000, function()
    for _, c in ipairs(get_clients(bufnr)) do
      if c.name == 'ember' and c.initialized and c.server_capabilities then
        client = c
        return true
      end
    end
    return false
  end, 100)
  if not ok then
    error('ember client did not attach/initialize within 60 s')
  end
  out.client_name = client.name
  out.client_count = #get_clients(bufnr)
  out.completion_provider = client.server_capabilities.completionProvider ~= nil
  out.inline_completion_provider = client.server_capabilities.inlineCompletionProvider ~= nil
  out.text_document_sync = client.server_capabilities.textDocumentSync
  out.omnifunc = vim.bo[bufnr].omnifunc
  step('attached')

  -- Type a new last line through Neovim's insert mode (didChange goes through Neovim's client).
  vim.cmd('set noautoindent nosmartindent nocindent indentexpr= formatoptions=')
  vim.api.nvim_feedkeys(keys('Go' .. typed .. '<Esc>'), 'xt', false)
  local last = vim.api.nvim_buf_line_count(bufnr)
  local line_text = vim.api.nvim_buf_get_lines(bufnr, last - 1, last, false)[1]
  out.typed_line = line_text
  local pos = { line = last - 1, character = #line_text } -- ASCII: bytes == UTF-16 units
  out.position = pos
  vim.wait(500) -- let the debounced didChange go out
  step('typed')

  -- Poll until the model has loaded and ember answers with text.
  local params = { textDocument = { uri = vim.uri_from_bufnr(bufnr) }, position = pos }
  local t0 = vim.loop.hrtime()
  local deadline = t0 + timeout_s * 1e9
  local attempts = 0
  local ember_result, ember_items
  while vim.loop.hrtime() < deadline do
    attempts = attempts + 1
    local responses = vim.lsp.buf_request_sync(bufnr, 'textDocument/completion', params, 20000)
    for client_id, resp in pairs(responses or {}) do
      if client_id == client.id and resp.result then
        local items = extract_items(resp.result)
        for _, item in ipairs(items) do
          if item_text(item) ~= '' then
            ember_result, ember_items = resp.result, items
          end
        end
      end
      if resp.err then
        out.last_error = resp.err
      end
    end
    if ember_result then
      break
    end
    vim.wait(1000)
  end
  out.attempts = attempts
  out.wait_s = (vim.loop.hrtime() - t0) / 1e9
  if not ember_result then
    error('no non-empty completion from ember within ' .. timeout_s .. ' s')
  end
  out.items = {}
  for _, item in ipairs(ember_items) do
    table.insert(out.items, {
      label = item.label,
      insertText = item.insertText,
      textEdit = item.textEdit,
      filterText = item.filterText,
      text = item_text(item),
    })
  end
  step('completion')

  -- What Neovim's own completion code turns the result into (the omnifunc popup's items).
  local cmp = to_complete_items(ember_result, '', client.id)
  out.complete_words = {}
  for _, c in ipairs(cmp) do
    table.insert(out.complete_words, c.word)
  end

  -- The user's way: <C-x><C-o> at the end of the typed line, in insert mode. nvim_feedkeys with
  -- 'x!' stays in insert mode until a key ends it, so a timer watches the popup menu and then
  -- accepts the selected item with <C-y> and leaves insert mode.
  vim.cmd('set completeopt=menu noshowmode')
  vim.api.nvim_win_set_cursor(0, { last, #line_text })
  local waited = 0
  local timer = vim.loop.new_timer()
  timer:start(100, 100, vim.schedule_wrap(function()
    waited = waited + 100
    local info = vim.fn.complete_info({ 'items', 'pum_visible', 'mode', 'selected' })
    local done = info.items and #info.items > 0
    if done or waited >= 30000 then
      timer:stop()
      timer:close()
      out.omni_mode = vim.fn.mode()
      out.omni_popup = done
      out.omni_selected = info.selected
      out.omni_words = {}
      for _, it in ipairs(info.items or {}) do
        table.insert(out.omni_words, it.word)
      end
      vim.api.nvim_feedkeys(keys(done and '<C-y><Esc>' or '<Esc>'), 'n', false)
    end
  end))
  vim.api.nvim_feedkeys(keys('A<C-x><C-o>'), 'xt!', false)
  out.lines_after_accept = vim.api.nvim_buf_get_lines(bufnr, last - 1, -1, false)
  step('omnifunc')

  out.progress = ember.progress_log
  out.status = ember.status()

  -- Did Neovim send didChange notifications for what was typed?
  vim.wait(200)
  local f = io.open(out.lsp_log, 'r')
  local log = f and f:read('*a') or ''
  if f then
    f:close()
  end
  local n = 0
  for _ in log:gmatch('textDocument/didChange') do
    n = n + 1
  end
  out.did_change_count = n
  out.did_open_logged = log:find('textDocument/didOpen', 1, true) ~= nil
  step('done')
end

local ok, err = xpcall(main, debug.traceback)
out.ok = ok
if not ok then
  out.error = tostring(err)
end
pcall(write_out)
for _, c in ipairs(vim.lsp.get_clients and vim.lsp.get_clients() or vim.lsp.get_active_clients()) do
  pcall(vim.lsp.stop_client, c.id, true)
end
vim.cmd('qa!')
